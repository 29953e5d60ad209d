//! Webhook notifications: the server's loop that delivers the store's outbox.
//!
//! **Owns:** how a notification is sent — its body ([`Body`], JSON or Slack's `{"text": …}`),
//! the HTTP request, which answers count as delivered, retries with backoff and the attempt
//! limit — and that a webhook's URL is only ever shown redacted. **Must not depend on:** the
//! engine, the data plane, the HTTP API or the Hub client; which notifications exist is the
//! store's (rows enqueued by the transaction that finishes a run, see `shardline-store`).
//!
//! # Delivery
//!
//! [`Notifier::deliver_due`] leases due rows ([`Store::claim_notifications`]: two servers never
//! hold one row at once), builds each body from the run as it is now, expands the URL's
//! `${ENV_VAR}` references from this process's environment, POSTs it with a timeout and records
//! the attempt ([`Store::record_delivery`]). A 2xx is delivered. A connection error, a timeout,
//! a 5xx, 408 or 429 is retried after the shared exponential backoff, until
//! [`NotifierConfig::max_attempts`]; any other answer (a 4xx: the hook is gone or refuses the
//! body) fails at once. A server that dies mid-request leaves a lease that expires, and the row
//! is sent again: receivers get each notification at least once, and exactly once unless a
//! server dies between their answer and the record of it.
//!
//! # Secrets
//!
//! URLs are stored as written, `${ENV_VAR}` unexpanded; errors and logs name a target only by
//! [`shardline_spec::notify::redact_url`], and HTTP errors are reported without their URL.

mod body;

use std::time::Duration;

use shardline_backoff::Backoff;
use shardline_spec::notify::{expand_env, redact_url};
use shardline_store::{
    DeliveryOutcome, NotificationLease, NotifyEvent, NotifyFormat, RunId, RunRow, Store, StoreError,
};
use tokio::sync::watch;

pub use body::{Body, SlackBody, TriggerInfo};

/// What can stop the notifier.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NotifyError {
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How a [`Notifier`] sends.
#[derive(Debug, Clone)]
pub struct NotifierConfig {
    /// The dashboard's address for links (`https://shardline.example.com`), without a trailing `/`.
    pub public_url: Option<String>,
    /// Attempts per notification before it is given up as failed.
    pub max_attempts: u32,
    /// Delays between attempts (the workspace's one formula).
    pub backoff: Backoff,
    /// The whole request, connecting included.
    pub timeout: Duration,
    /// How long a claimed notification is held; longer than `timeout`.
    pub lease: Duration,
    /// How often the outbox is looked at when it was empty.
    pub poll: Duration,
    /// Notifications claimed at once.
    pub batch: u32,
}

impl Default for NotifierConfig {
    fn default() -> NotifierConfig {
        NotifierConfig {
            public_url: None,
            max_attempts: 8,
            backoff: Backoff { base: Duration::from_secs(1), cap: Duration::from_secs(600), spread: (0.5, 1.0) },
            timeout: Duration::from_secs(10),
            lease: Duration::from_secs(60),
            poll: Duration::from_secs(1),
            batch: 16,
        }
    }
}

/// Delivers the outbox of one store.
#[derive(Clone)]
pub struct Notifier {
    store: Store,
    http: reqwest::Client,
    config: NotifierConfig,
}

impl Notifier {
    pub fn new(store: Store, config: NotifierConfig) -> Result<Notifier, NotifyError> {
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            // Err only means another thread installed one first.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let http = reqwest::Client::builder()
            // A redirect would carry the body somewhere the spec did not name.
            .redirect(reqwest::redirect::Policy::none())
            .timeout(config.timeout)
            .user_agent(concat!("shardline-notify/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| NotifyError::Client(e.without_url().to_string()))?;
        Ok(Notifier { store, http, config })
    }

    /// Delivers until `stop` turns true; store errors are logged and retried at the next poll.
    pub async fn run(self, mut stop: watch::Receiver<bool>) {
        loop {
            if *stop.borrow() {
                return;
            }
            let idle = match self.deliver_due().await {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => {
                    tracing::warn!(error = %e, "notifications: cannot read the outbox");
                    true
                }
            };
            if idle {
                tokio::select! {
                    _ = stop.changed() => {}
                    () = tokio::time::sleep(self.config.poll) => {}
                }
            }
        }
    }

    /// One pass: claims the due notifications and makes one attempt at each. Returns how many
    /// it attempted.
    pub async fn deliver_due(&self) -> Result<usize, NotifyError> {
        let leases = self.store.claim_notifications(self.config.batch, self.config.lease).await?;
        let n = leases.len();
        for lease in leases {
            let outcome = self.attempt(&lease).await?;
            let target = redact_url(&lease.notification.url);
            match &outcome {
                DeliveryOutcome::Delivered { status } => {
                    tracing::info!(id = lease.notification.id, %target, status, "notification delivered");
                }
                DeliveryOutcome::Failed { error, retry_in, .. } => {
                    tracing::warn!(id = lease.notification.id, %target, error, retry_in = ?retry_in, "notification not delivered");
                }
            }
            self.store.record_delivery(&lease, &outcome).await?;
        }
        Ok(n)
    }

    /// The body of a notification as it would be sent now.
    pub async fn body(&self, lease: &NotificationLease) -> Result<(Body, Option<TriggerInfo>), NotifyError> {
        let n = &lease.notification;
        let run: Option<RunRow> = match n.run {
            Some(id) => self.store.get_run(RunId(id.0)).await?,
            None => None,
        };
        let trigger = match n.trigger_id {
            Some(id) => self.store.trigger(id).await?.map(|t| TriggerInfo {
                pipeline: t.pipeline,
                summary: t.summary,
                error: t.last_error,
            }),
            None => None,
        };
        let trigger = trigger
            .or_else(|| n.detail.as_ref().map(|p| TriggerInfo { pipeline: p.clone(), ..TriggerInfo::default() }));
        let base = self.config.public_url.as_deref().map(|u| u.trim_end_matches('/'));
        Ok((Body::new(n, run.as_ref(), trigger.as_ref(), base), trigger))
    }

    async fn attempt(&self, lease: &NotificationLease) -> Result<DeliveryOutcome, NotifyError> {
        let n = &lease.notification;
        let (body, trigger) = self.body(lease).await?;
        let payload = match n.format {
            NotifyFormat::Json => serde_json::to_vec(&body),
            NotifyFormat::Slack => serde_json::to_vec(&SlackBody { text: body.text(n.event, trigger.as_ref()) }),
        };
        let payload = match payload {
            Ok(p) => p,
            Err(e) => return Ok(self.failed(lease, None, format!("cannot encode the body: {e}"), false)),
        };
        let url = match expand_env(&n.url, |name| std::env::var(name).ok()) {
            Ok(u) => u,
            Err(why) => return Ok(self.failed(lease, None, why, true)),
        };
        let sent = self
            .http
            .post(&url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header("X-Shardline-Event", n.event.as_str())
            .body(payload)
            .send()
            .await;
        Ok(match sent {
            Ok(response) => {
                let status = response.status();
                if status.is_success() {
                    DeliveryOutcome::Delivered { status: status.as_u16() }
                } else {
                    let retry = status.is_server_error() || matches!(status.as_u16(), 408 | 429);
                    self.failed(lease, Some(status.as_u16()), format!("the receiver answered {status}"), retry)
                }
            }
            Err(e) => {
                let message = scrub(&error_chain(&e.without_url()), &[&url, &n.url], &redact_url(&n.url));
                self.failed(lease, None, message, true)
            }
        })
    }

    /// A failed attempt: retried after the backoff of its count while attempts remain.
    fn failed(&self, lease: &NotificationLease, status: Option<u16>, error: String, retry: bool) -> DeliveryOutcome {
        let made = lease.notification.attempts.saturating_add(1);
        let retry_in = (retry && made < self.config.max_attempts).then(|| self.config.backoff.jittered(made));
        DeliveryOutcome::Failed { status, error, retry_in }
    }
}

/// An error and its sources, `: `-joined (reqwest's own message is only the outermost).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        source = inner.source();
    }
    s
}

/// `text` with every occurrence of the given URLs replaced by the redacted form.
fn scrub(text: &str, urls: &[&str], redacted: &str) -> String {
    let mut out = text.to_string();
    for u in urls.iter().filter(|u| !u.is_empty()) {
        out = out.replace(u, redacted);
    }
    out
}

/// The events a server's `--notify` targets are told about when `--notify-on` is not given.
pub const DEFAULT_SERVER_EVENTS: &[NotifyEvent] = &[NotifyEvent::Failed, NotifyEvent::Succeeded];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_scrubbed_from_errors() {
        let s = scrub(
            "error for http://h/hook?token=abc: refused",
            &["http://h/hook?token=abc"],
            "http://h/hook?token=***",
        );
        assert_eq!(s, "error for http://h/hook?token=***: refused");
    }
}
