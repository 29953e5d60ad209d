//! The metric families and their registration: names, help texts, labels and buckets.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StateLabel {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindStateLabels {
    pub kind: String,
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindLabel {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindOutcomeLabels {
    pub kind: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct BudgetLabel {
    /// `error` (the task failed) or `lost` (its worker was lost).
    pub budget: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct WorkerLabel {
    pub worker: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct WorkerResourceLabels {
    pub worker: String,
    /// `cpus`, `memory_bytes`, `gpus` or `scratch_bytes`.
    pub resource: String,
}

type F64Gauge = Gauge<f64, AtomicU64>;
type Buckets = fn() -> Histogram;

/// Pickups are expected within a second when a worker has room, minutes when the queue is deep.
fn pickup_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.01, 2.0, 20))
}

/// Tasks take from milliseconds (a cached step) to hours (a large download).
fn duration_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.05, 2.0, 22))
}

/// Every family the endpoint shows. Gauges are set from a snapshot of the store at each scrape;
/// counters and histograms grow from the attempts that ended since the last one.
pub(crate) struct Families {
    pub runs: Family<StateLabel, Gauge>,
    pub tasks: Family<KindStateLabels, Gauge>,
    pub queue_depth: Gauge,
    pub queue_oldest: F64Gauge,
    pub pickup: Family<KindLabel, Histogram, Buckets>,
    pub duration: Family<KindOutcomeLabels, Histogram, Buckets>,
    pub attempts: Family<KindOutcomeLabels, Counter>,
    pub lease_expiries: Counter,
    pub retries: Family<BudgetLabel, Counter>,
    pub bytes_converted: Counter,
    pub bytes_downloaded: Counter,
    pub bytes_uploaded: Counter,
    pub trigger_checks: Counter,
    pub trigger_errors: Counter,
    pub trigger_fired: Counter,
    pub workers: Family<StateLabel, Gauge>,
    pub worker_resources: Family<WorkerResourceLabels, Gauge>,
    pub worker_used: Family<WorkerResourceLabels, Gauge>,
    pub worker_heartbeat_age: Family<WorkerLabel, F64Gauge>,
    pub worker_disk_free: Family<WorkerLabel, Gauge>,
    pub worker_disk_total: Family<WorkerLabel, Gauge>,
    pub worker_scratch_free: Family<WorkerLabel, Gauge>,
    pub collect_errors: Counter,
}

impl Families {
    pub fn register(registry: &mut Registry) -> Families {
        let f = Families {
            runs: Family::default(),
            tasks: Family::default(),
            queue_depth: Gauge::default(),
            queue_oldest: F64Gauge::default(),
            pickup: Family::new_with_constructor(pickup_buckets),
            duration: Family::new_with_constructor(duration_buckets),
            attempts: Family::default(),
            lease_expiries: Counter::default(),
            retries: Family::default(),
            bytes_converted: Counter::default(),
            bytes_downloaded: Counter::default(),
            bytes_uploaded: Counter::default(),
            trigger_checks: Counter::default(),
            trigger_errors: Counter::default(),
            trigger_fired: Counter::default(),
            workers: Family::default(),
            worker_resources: Family::default(),
            worker_used: Family::default(),
            worker_heartbeat_age: Family::default(),
            worker_disk_free: Family::default(),
            worker_disk_total: Family::default(),
            worker_scratch_free: Family::default(),
            collect_errors: Counter::default(),
        };
        let r = registry;
        r.register("runs", "Runs by state", f.runs.clone());
        r.register("tasks", "Tasks by step kind and state", f.tasks.clone());
        r.register("queue_depth", "Ready tasks whose backoff has passed (claimable now)", f.queue_depth.clone());
        r.register_with_unit(
            "queue_oldest_ready",
            "Age of the oldest claimable task",
            Unit::Seconds,
            f.queue_oldest.clone(),
        );
        r.register_with_unit(
            "task_pickup",
            "Time from a task becoming claimable to a worker leasing it, by step kind",
            Unit::Seconds,
            f.pickup.clone(),
        );
        r.register_with_unit(
            "task_duration",
            "Duration of ended attempts by step kind and outcome",
            Unit::Seconds,
            f.duration.clone(),
        );
        r.register("attempts", "Ended attempts by step kind and outcome", f.attempts.clone());
        r.register(
            "lease_expiries",
            "Leases that expired without a completion (lost workers)",
            f.lease_expiries.clone(),
        );
        r.register("retries", "Ended attempts that were retried, by the budget they drew on", f.retries.clone());
        r.register_with_unit(
            "converted",
            "Bytes written by conversions (rank files, reshards, exports)",
            Unit::Bytes,
            f.bytes_converted.clone(),
        );
        r.register_with_unit(
            "downloaded",
            "Bytes of releases fetched by download steps",
            Unit::Bytes,
            f.bytes_downloaded.clone(),
        );
        r.register_with_unit("uploaded", "Bytes copied by upload steps", Unit::Bytes, f.bytes_uploaded.clone());
        r.register("trigger_checks", "Trigger checks made by this server", f.trigger_checks.clone());
        r.register("trigger_errors", "Trigger checks that failed on this server", f.trigger_errors.clone());
        r.register("trigger_fired", "Runs started by this server's triggers", f.trigger_fired.clone());
        r.register("workers", "Registered workers by state", f.workers.clone());
        r.register("worker_resources", "What each active worker offers", f.worker_resources.clone());
        r.register("worker_resources_used", "What each active worker's leases use", f.worker_used.clone());
        r.register_with_unit(
            "worker_heartbeat_age",
            "Time since each active worker's last heartbeat",
            Unit::Seconds,
            f.worker_heartbeat_age.clone(),
        );
        r.register_with_unit(
            "worker_disk_free",
            "Free space each active worker measured on its work directory's file system",
            Unit::Bytes,
            f.worker_disk_free.clone(),
        );
        r.register_with_unit(
            "worker_disk_total",
            "Size of each active worker's work directory's file system",
            Unit::Bytes,
            f.worker_disk_total.clone(),
        );
        r.register_with_unit(
            "worker_scratch_free",
            "Scratch each active worker offers to claims: its disk's free space less its reserve and its leases",
            Unit::Bytes,
            f.worker_scratch_free.clone(),
        );
        r.register("collect_errors", "Scrapes that could not read the job store", f.collect_errors.clone());
        // Both budgets are shown from the start, so a rate over them never starts from nothing.
        for budget in ["error", "lost"] {
            f.retries.get_or_create(&BudgetLabel { budget: budget.to_string() }).inc_by(0);
        }
        f
    }
}
