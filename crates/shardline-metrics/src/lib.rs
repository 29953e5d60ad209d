/*!
Prometheus metrics of the Shardline orchestrator, in the text exposition format
(`shardline server --http` serves them at `/metrics`).

**Owns:** the metric families (names, labels, buckets) and how they are derived from the job
store. **Must not depend on:** the engine, the web crate or the triggers (the server hands trigger
checks in through [`Metrics::observe_trigger_checks`]).

# Where the numbers come from

Workers write to the store, not to a server, so every number is read from the store:

- **Gauges** (runs and tasks by state, the claimable queue and the age of its oldest task,
  workers, their resources and the disks they measured) are a snapshot taken at each scrape.
- **Counters and histograms** (attempts by outcome, lease expiries, retries, pickup latency,
  durations, bytes converted, downloaded and uploaded) grow from the attempts that *ended* since
  the previous scrape, read in order of their end time. The window stops [`Metrics::lag`]
  before the database's clock: an attempt's end time is its transaction's time, so a
  transaction that commits late still lands in a later window instead of being skipped. The
  first scrape reads the whole history, so every server shows the same totals (take `max`
  across servers, not `sum`) and a restart does not reset them.
- **Trigger checks** are counted by the server that makes them (per process).
*/

mod families;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;
use shardline_control::graph::kinds;
use shardline_control::TaskOutput;
use shardline_store::{AttemptKind, AttemptOutcome, EndedAttempt, EndedCursor, Store, StoreError, WorkerState};
use tokio::sync::Mutex;

use families::{
    BudgetLabel, Families, KindLabel, KindOutcomeLabels, KindStateLabels, StateLabel, WorkerLabel, WorkerResourceLabels,
};

/// Ended attempts read per store call.
const PAGE: i64 = 5_000;

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("reading the job store: {0}")]
    Store(#[from] StoreError),
    #[error("encoding the metrics: {0}")]
    Encode(#[from] std::fmt::Error),
}

/// The metrics of one server.
pub struct Metrics {
    store: Store,
    lag: Duration,
    registry: Registry,
    families: Families,
    /// Where the counters' window ends: attempts that ended at or before it are counted.
    /// Held across a whole scrape, so concurrent scrapes never count an attempt twice.
    counted_to: Mutex<DateTime<Utc>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").field("lag", &self.lag).finish_non_exhaustive()
    }
}

impl Metrics {
    /// Metrics of `store`, counters read from the beginning of its history.
    pub fn new(store: Store) -> Arc<Metrics> {
        Metrics::with_lag(store, Duration::from_secs(2))
    }

    /// Like [`Metrics::new`], with the counters' window ending `lag` before the database's
    /// clock (how late an attempt's transaction may commit and still be counted).
    pub fn with_lag(store: Store, lag: Duration) -> Arc<Metrics> {
        let mut registry = Registry::with_prefix("shardline");
        let families = Families::register(&mut registry);
        Arc::new(Metrics { store, lag, registry, families, counted_to: Mutex::new(DateTime::UNIX_EPOCH) })
    }

    /// How long before the database's clock the counters' window ends.
    pub fn lag(&self) -> Duration {
        self.lag
    }

    /// Counts one pass of a trigger poller: `checked` triggers checked, `errors` of them failed,
    /// `fired` runs started.
    pub fn observe_trigger_checks(&self, checked: u64, errors: u64, fired: u64) {
        self.families.trigger_checks.inc_by(checked);
        self.families.trigger_errors.inc_by(errors);
        self.families.trigger_fired.inc_by(fired);
    }

    /// Reads the store and renders every family in the text exposition format. A store that
    /// cannot be read is an error (and counted in `shardline_collect_errors_total`).
    pub async fn render(&self) -> Result<String, MetricsError> {
        let mut counted_to = self.counted_to.lock().await;
        if let Err(e) = self.collect(&mut counted_to).await {
            self.families.collect_errors.inc();
            return Err(e);
        }
        let mut out = String::new();
        encode(&mut out, &self.registry)?;
        Ok(out)
    }

    async fn collect(&self, counted_to: &mut DateTime<Utc>) -> Result<(), MetricsError> {
        self.snapshot().await?;
        let to = self.store.metrics_horizon(self.lag).await?;
        if to <= *counted_to {
            return Ok(());
        }
        let mut after: Option<EndedCursor> = None;
        loop {
            let page = self.store.ended_attempts(*counted_to, to, after, PAGE).await?;
            for a in &page.attempts {
                self.count(a);
            }
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        *counted_to = to;
        Ok(())
    }

    /// The gauges: what the store holds now.
    async fn snapshot(&self) -> Result<(), MetricsError> {
        let f = &self.families;
        let counts = self.store.state_counts().await?;
        f.runs.clear();
        for (state, n) in &counts.runs {
            f.runs.get_or_create(&StateLabel { state: state.to_string() }).set(*n);
        }
        f.tasks.clear();
        for (kind, state, n) in &counts.tasks {
            f.tasks.get_or_create(&KindStateLabels { kind: kind.clone(), state: state.to_string() }).set(*n);
        }
        f.queue_depth.set(counts.claimable);
        f.queue_oldest.set(counts.oldest_claimable.map_or(0.0, |t| seconds(counts.now - t)));

        let workers = self.store.list_workers().await?;
        let leased = self.store.leased_tasks().await?;
        f.workers.clear();
        f.worker_resources.clear();
        f.worker_used.clear();
        f.worker_heartbeat_age.clear();
        f.worker_disk_free.clear();
        f.worker_disk_total.clear();
        f.worker_scratch_free.clear();
        for w in &workers {
            f.workers.get_or_create(&StateLabel { state: w.state.to_string() }).inc();
            if w.state != WorkerState::Active {
                continue;
            }
            let mut used = shardline_store::Resources::default();
            for l in leased.iter().filter(|l| l.owner == w.id) {
                used.cpus += l.resources.cpus;
                used.memory += l.resources.memory;
                used.gpus += l.resources.gpus;
                used.scratch += l.resources.scratch;
            }
            for (family, r) in [(&f.worker_resources, &w.resources), (&f.worker_used, &used)] {
                for (resource, value) in [
                    ("cpus", u64::from(r.cpus)),
                    ("memory_bytes", r.memory),
                    ("gpus", u64::from(r.gpus)),
                    ("scratch_bytes", r.scratch),
                ] {
                    let labels = WorkerResourceLabels { worker: w.name.clone(), resource: resource.to_string() };
                    family.get_or_create(&labels).set(i64::try_from(value).unwrap_or(i64::MAX));
                }
            }
            let worker = WorkerLabel { worker: w.name.clone() };
            f.worker_heartbeat_age.get_or_create(&worker).set(seconds(counts.now - w.last_heartbeat).max(0.0));
            // Only workers that measure their disk report one.
            if let Some(d) = w.disk {
                let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
                f.worker_disk_free.get_or_create(&worker).set(gauge(d.free));
                f.worker_disk_total.get_or_create(&worker).set(gauge(d.total));
                f.worker_scratch_free.get_or_create(&worker).set(gauge(d.scratch_free));
            }
        }
        Ok(())
    }

    /// The counters and histograms of one ended attempt.
    fn count(&self, a: &EndedAttempt) {
        let f = &self.families;
        let labels = KindOutcomeLabels { kind: a.step_kind.clone(), outcome: a.outcome.to_string() };
        f.attempts.get_or_create(&labels).inc();
        f.duration.get_or_create(&labels).observe(seconds(a.ended_at - a.started_at).max(0.0));
        if let Some(ready) = a.ready_at {
            // A task readied with a backoff becomes claimable at `ready_at`, never before.
            let pickup = seconds(a.started_at - ready).max(0.0);
            f.pickup.get_or_create(&KindLabel { kind: a.step_kind.clone() }).observe(pickup);
        }
        if a.outcome == AttemptOutcome::Expired {
            f.lease_expiries.inc();
        }
        if a.retried {
            if let Some(kind) = a.outcome.kind() {
                let budget = match kind {
                    AttemptKind::Error => "error",
                    AttemptKind::Lost => "lost",
                };
                f.retries.get_or_create(&BudgetLabel { budget: budget.to_string() }).inc();
            }
        }
        if let Some(output) = &a.output {
            let out = TaskOutput::from_value(output);
            if out.is_cached() {
                return; // served from the step cache: nothing was moved
            }
            // A download counts what came over the network (a local release: nothing).
            let (counter, bytes) = match a.step_kind.as_str() {
                kinds::DOWNLOAD => (&f.bytes_downloaded, out.bytes_downloaded),
                kinds::RANK | kinds::RESHARD | kinds::EXPORT => (&f.bytes_converted, out.bytes),
                kinds::UPLOAD => (&f.bytes_uploaded, out.bytes),
                _ => return,
            };
            counter.inc_by(bytes.unwrap_or(0));
        }
    }
}

fn seconds(d: chrono::TimeDelta) -> f64 {
    d.num_milliseconds() as f64 / 1000.0
}
