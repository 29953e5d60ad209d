//! `shardline triggers` (the registered triggers with their last and next firing) and the
//! trigger loop `shardline server --pipelines DIR` runs next to the reaper.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use shardline_hub::HubClient;
use shardline_metrics::Metrics;
use shardline_spec::policy::PathPolicy;
use shardline_store::{Store, TriggerRecord};
use shardline_triggers::{load_dir, Poller, PollerOptions, SystemClock, TickReport};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::orchestrate::{runtime, StateArgs};

#[derive(Args, Debug)]
pub struct TriggersArgs {
    /// One JSON array of trigger records instead of the table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub state: StateArgs,
}

/// `server` options for triggers.
#[derive(Args, Debug, Default)]
pub struct TriggerServeArgs {
    /// Run the `triggers:` of the pipeline specs in this directory (schedules and Hub watches;
    /// the Hub endpoint and token come from HF_ENDPOINT and HF_TOKEN).
    #[arg(long, value_name = "DIR")]
    pub pipelines: Option<PathBuf>,
}

pub fn run_triggers(args: TriggersArgs) -> Result<ExitCode> {
    runtime()?.block_on(async move {
        let store = args.state.store().await?;
        let triggers = store.list_triggers().await?;
        if args.json {
            println!("{}", serde_json::to_string(&triggers)?);
        } else {
            print_table(&triggers);
        }
        Ok(ExitCode::SUCCESS)
    })
}

fn print_table(triggers: &[TriggerRecord]) {
    if triggers.is_empty() {
        println!("no triggers (start `shardline server --pipelines DIR` with specs that have `triggers:`)");
        return;
    }
    println!(
        "{:<20} {:>2}  {:<8} {:<50} {:<20} {:>6}  {:<20} {:<12} error",
        "pipeline", "#", "kind", "trigger", "last fired", "run", "next", "last sha"
    );
    for t in triggers {
        let error = match (&t.last_error, t.errors) {
            (Some(e), n) if n > 0 => format!("{n}× {}", one_line(e)),
            (Some(e), _) => format!("(recovered) {}", one_line(e)),
            (None, _) => "-".to_string(),
        };
        println!(
            "{:<20} {:>2}  {:<8} {:<50} {:<20} {:>6}  {:<20} {:<12} {}",
            t.pipeline,
            t.position,
            t.kind,
            t.summary,
            t.last_fired_at.map_or("-".to_string(), |t| t.format("%Y-%m-%d %H:%M:%SZ").to_string()),
            t.last_run.map_or("-".to_string(), |r| r.0.to_string()),
            t.next_at.map_or("-".to_string(), |t| t.format("%Y-%m-%d %H:%M:%SZ").to_string()),
            t.last_sha.as_deref().map_or("-", |s| s.get(..12).unwrap_or(s)),
            error
        );
    }
}

fn one_line(s: &str) -> String {
    let line = s.lines().next().unwrap_or("");
    if line.chars().count() > 80 {
        format!("{}…", line.chars().take(80).collect::<String>())
    } else {
        line.to_string()
    }
}

/// Starts the trigger loop when `--pipelines` is given: loads and lints the specs (any error
/// stops the server before it starts), registers their triggers, then polls until `shutdown`.
pub async fn start(
    args: &TriggerServeArgs,
    store: &Store,
    metrics: &Arc<Metrics>,
    policy: Option<Arc<PathPolicy>>,
    work_dir: PathBuf,
    artifacts: Option<String>,
    shutdown: watch::Receiver<bool>,
) -> Result<Option<JoinHandle<()>>> {
    let Some(dir) = &args.pipelines else {
        return Ok(None);
    };
    let base = std::env::current_dir()?;
    let pipelines = load_dir(dir, &base).with_context(|| format!("loading pipelines from {}", dir.display()))?;
    let hub = HubClient::from_env().context("configuring the Hub client for watch triggers")?;
    let count: usize = pipelines.iter().map(|p| p.triggers.len()).sum();
    let counted = metrics.clone();
    let options = PollerOptions { policy, artifacts, ..PollerOptions::new(base, work_dir) };
    let poller = Poller::new(store.clone(), hub, Arc::new(SystemClock), pipelines, options).with_observer(Arc::new(
        move |r: &TickReport| {
            counted.observe_trigger_checks(r.checked as u64, r.errors.len() as u64, r.fired.len() as u64)
        },
    ));
    let registered = poller.register().await.context("registering triggers")?;
    eprintln!("server: {count} trigger(s) of {} pipeline(s) from {}", poller.pipelines().len(), dir.display());
    debug_assert_eq!(registered.len(), count);
    Ok(Some(tokio::spawn(poller.run(shutdown))))
}
