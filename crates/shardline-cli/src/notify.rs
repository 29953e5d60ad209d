//! `shardline server --notify URL`: the server-wide webhooks, and the loop that delivers every
//! notification (theirs and the specs' `notify:`) next to the reaper.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use shardline_notify::{Notifier, NotifierConfig, DEFAULT_SERVER_EVENTS};
use shardline_spec::notify::{check_url, redact_url};
use shardline_store::{NotifyEvent, NotifyFormat, NotifyTarget, Store};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// `server` options for notifications.
#[derive(Args, Debug, Clone, Default)]
pub struct NotifyArgs {
    /// Send every pipeline's notifications to this webhook too (repeatable; `${ENV_VAR}` in it is
    /// read from this server's environment when sending).
    #[arg(long = "notify", value_name = "URL", env = "SHARDLINE_NOTIFY", value_delimiter = ' ')]
    pub urls: Vec<String>,
    /// The events `--notify` webhooks are told about: succeeded, failed, cancelled, trigger-error
    /// (default: failed,succeeded).
    #[arg(long, value_name = "EVENTS", value_delimiter = ',', env = "SHARDLINE_NOTIFY_ON")]
    pub notify_on: Vec<String>,
    /// The body `--notify` webhooks get: json or slack.
    #[arg(long, value_name = "FORMAT", default_value = "json", env = "SHARDLINE_NOTIFY_FORMAT")]
    pub notify_format: String,
    /// The dashboard's address as people reach it, for links in notifications
    /// (default: the `--http` address).
    #[arg(long, value_name = "URL", env = "SHARDLINE_PUBLIC_URL")]
    pub public_url: Option<String>,
}

impl NotifyArgs {
    fn targets(&self) -> Result<Vec<NotifyTarget>> {
        let events = if self.notify_on.is_empty() {
            DEFAULT_SERVER_EVENTS.to_vec()
        } else {
            self.notify_on
                .iter()
                .map(|e| e.trim().parse::<NotifyEvent>().map_err(anyhow::Error::msg))
                .collect::<Result<Vec<_>>>()
                .context("--notify-on")?
        };
        let format: NotifyFormat = self.notify_format.parse().map_err(anyhow::Error::msg).context("--notify-format")?;
        let mut out = Vec::new();
        for url in self.urls.iter().filter(|u| !u.trim().is_empty()) {
            if let Err(why) = check_url(url) {
                bail!("--notify {}: {why}", redact_url(url));
            }
            out.push(NotifyTarget { url: url.clone(), events: events.clone(), format });
        }
        Ok(out)
    }
}

/// Records this server's `--notify` targets (replacing the ones an earlier start recorded) and
/// starts delivering the store's notifications.
pub async fn start(
    args: &NotifyArgs,
    store: &Store,
    http: Option<SocketAddr>,
    stop: watch::Receiver<bool>,
) -> Result<JoinHandle<()>> {
    let targets = args.targets()?;
    store.set_default_notify_targets(&targets).await.context("recording the --notify webhooks")?;
    for t in &targets {
        eprintln!("server: notifying {} ({} body)", redact_url(&t.url), t.format);
    }
    let public_url = args.public_url.clone().or_else(|| http.map(|a| format!("http://{a}")));
    let config = NotifierConfig { public_url, ..NotifierConfig::default() };
    let notifier = Notifier::new(store.clone(), config).context("starting the notifier")?;
    Ok(tokio::spawn(notifier.run(stop)))
}

/// How long shutdown waits for an attempt under way.
pub const DRAIN: Duration = Duration::from_secs(15);
