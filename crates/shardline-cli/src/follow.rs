//! Following a run from the command line (`shardline run`): each step's progress as it changes,
//! why ready tasks wait while nothing is leased, and the run's final state.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{bail, Result};
use shardline_control::{TaskOutput, TaskProgress};
use shardline_store::{RunId, RunState, Store, TaskState};

use crate::report::bytes;

/// Prints step progress until the run ends; returns its final state.
pub(crate) async fn follow_run(store: &Store, run: RunId) -> Result<RunState> {
    let mut last: BTreeMap<String, String> = BTreeMap::new();
    loop {
        let Some(r) = store.get_run(run).await? else { bail!("run {} disappeared", run.0) };
        let tasks = store.run_tasks(run).await?;
        let mut by_step: BTreeMap<String, (usize, usize, usize, u64, bool)> = BTreeMap::new();
        for t in &tasks {
            let e = by_step.entry(t.step_id.clone()).or_default();
            e.1 += 1;
            if t.state == TaskState::Succeeded {
                e.0 += 1;
                if t.output.as_ref().is_some_and(|o| TaskOutput::from_value(o).is_cached()) {
                    e.4 = true;
                }
            }
            if t.state == TaskState::Failed {
                e.2 += 1;
            }
            e.3 += t.progress.as_ref().and_then(TaskProgress::from_value).map_or(0, |p| p.bytes);
        }
        for (step, (done, total, failed, b, cached)) in &by_step {
            let line = format!(
                "{step}: {done}/{total} tasks{}{}{}",
                if *failed > 0 { format!(", {failed} failed") } else { String::new() },
                if *b > 0 { format!(", {}", bytes(*b)) } else { String::new() },
                if *cached { " (cached)" } else { "" }
            );
            if last.get(step) != Some(&line) {
                eprintln!("  {line}");
                last.insert(step.clone(), line);
            }
        }
        waiting_note(store, &tasks, &mut last).await?;
        if r.state.is_terminal() {
            match r.state {
                RunState::Succeeded => eprintln!("run {} succeeded", run.0),
                s => eprintln!("run {} {}: {}", run.0, s.as_str(), r.error.unwrap_or_default()),
            }
            return Ok(r.state);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// While none of the run's tasks is leased, why its ready ones wait (the dashboard's reason:
/// a disk below its reserve, a GPU no worker has), printed when it changes; a one-shot run that
/// cannot go on says so instead of waiting in silence.
async fn waiting_note(
    store: &Store,
    tasks: &[shardline_store::TaskRow],
    last: &mut BTreeMap<String, String>,
) -> Result<()> {
    let ready: Vec<_> = tasks.iter().filter(|t| t.state == TaskState::Ready).collect();
    if ready.is_empty() || tasks.iter().any(|t| t.state == TaskState::Leased) {
        return Ok(());
    }
    let held: Vec<shardline_web::view::Held> = store
        .leased_tasks()
        .await?
        .into_iter()
        .map(|l| shardline_web::view::Held { worker: l.owner.0, resources: l.resources })
        .collect();
    let workers = store.list_workers().await?;
    let now = chrono::Utc::now();
    let mut why: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for t in &ready {
        let reason = shardline_web::view::ready_reason(&t.resources, &workers, &held, now);
        // A worker with room is about to claim it: nothing to explain.
        if !reason.starts_with("waiting for a worker to claim it") {
            why.entry(reason).or_default().push(&t.name);
        }
    }
    let line = why
        .iter()
        .map(|(reason, names)| match names.as_slice() {
            [one] => format!("{one} waits: {reason}"),
            [first, ..] => format!("{first} and {} more wait: {reason}", names.len() - 1),
            [] => String::new(),
        })
        .collect::<Vec<_>>()
        .join("\n  ");
    if !line.is_empty() && last.get("\0waiting") != Some(&line) {
        eprintln!("  {line}");
        last.insert("\0waiting".into(), line);
    }
    Ok(())
}
