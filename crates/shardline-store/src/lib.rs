/*!
The job store of the Shardline orchestrator: pipelines, runs, the tasks of a run and their
dependencies, leases of tasks to workers, attempts, logs, events and the step cache — on
PostgreSQL (shared deployments) or SQLite (the embedded default), behind one API.

**Owns:** every table and every SQL statement on them (API tokens included), and task state:
only the store changes it. **Must not depend on:** any workspace crate; payloads and outputs
are opaque JSON to it, typed by `shardline-control`.

# Leasing

A worker asks for work with the resources it has free; [`Store::claim`] hands it at most one
`ready` task that fits, as a [`Lease`] with a fencing token. From then on every call about that
task carries the lease, and the store accepts it only while the token is the task's current
one:

- [`Store::heartbeat`] extends the lease (returns `false` once it is lost: stop working);
- [`Store::complete`] records the outcome (returns `false` for a stale token: discard the work);
- [`Store::reap_expired`] turns leases nobody extended into retries (with backoff) or failures
  ("worker lost 10 times: lease expired (last owner gpu-7)"), so a dead worker never leaves a
  task or a run "running" for ever.

Every call is one short transaction; nothing holds a transaction or a row lock while a task
runs. On PostgreSQL the claim is one statement (`FOR UPDATE SKIP LOCKED`, resource filter in the
`WHERE`), readiness is announced with `NOTIFY` and [`Store::wait_for_work`] listens on a
dedicated connection with a jittered poll as fallback. On SQLite writers are serialized
(`BEGIN IMMEDIATE`) and wake-ups are in-process.

# Decisions

- **Idempotent submission.** `runs.dedupe_key` has a unique index over runs that are queued,
  running or succeeded: an identical submission returns the existing run (`created: false`);
  once every run with the key failed or was cancelled, a new one is created. Retrying such an
  old run while a newer one holds the key is refused (`StoreError::DedupeConflict`).
- **Fencing.** `tasks.lease_token` grows by one at every claim and is never reset; heartbeat
  and completion match it, and a completion repeated after a lost reply is recognised from the
  attempt history (`attempts`, keyed by task and token).
- **Attempts.** `tasks.attempt` counts every lease ever started, so `(task, attempt)` names one
  attempt for its logs for ever; `retry_run` grants fresh budgets by moving `attempt_base` and
  zeroing `lost`.
- **Two retry budgets.** A lease that expired is a lost worker (killed, preempted, cut off from
  the database), not a fault of the task: it counts against `max_lost` (`tasks.lost`, default
  [`DEFAULT_MAX_LOST`]); an error the worker reports, or a timeout, counts against
  `max_attempts`. Each retry waits the backoff of its own budget's count. Every ended attempt
  records which budget it drew on (`attempts.kind`: [`AttemptKind`]), and a run that fails says
  which ran out ("failed after 3 attempts: …", "failed: worker lost 10 times: …").
- **Opening.** Migrations run once, under a lock that works across processes (a lock file next
  to a SQLite database, an advisory lock on PostgreSQL); openers that find it taken wait for it,
  at most [`StoreOptions::migrate_wait`] (see [`Store::connect`]).
- **Readiness and run completion.** A success makes the dependents whose needs have all
  succeeded ready in its own transaction (their rows locked first, their needs read afresh
  after), and counts down the run's `open_tasks`; the run succeeds at zero. A terminal failure
  fails the run with the reason and cancels its unfinished tasks.
- **Lock order.** Task rows before the run's row, in every operation; the remaining deadlock
  windows (a claim moving a queued run to running while it is cancelled) are resolved by the
  database and the call is retried.
- **Events** are numbered in the order readers can see them: on PostgreSQL `events_after` gives
  ids to committed rows in insertion order, so a follower never skips an event whose
  transaction committed late.
- **Time** is the database's: `now()` on PostgreSQL, `unixepoch('subsec')` in milliseconds on
  SQLite. Workers never compare their clock with a lease's expiry.
- **Scratch.** A claim leases a task only if its `scratch` fits the scratch the worker offers,
  which the worker measures on its disk. Where a need is known only once a task ran (a shard's
  rank files, sized by its plan), that task's success raises it ([`Store::complete_with`]) in the
  transaction that makes the dependents ready: a rank task is never claimable with a stale need.
- **Priority.** `tasks.priority` orders claims (higher first, then readiness time, then id); a
  task takes its run's priority when it is added (`RunOptions::priority`, from the spec's
  `priority:` or `submit --priority`), so a high-priority run submitted last is claimed first.
- **Concurrency limits and pools.** A run holds its pipeline's place (`concurrency_key`,
  `concurrency_limit`) and a slot of its pool (`pools`, defined by the server) while it is
  `running`, from its first claim until it ends. The claim leases a task of a queued run only
  when fewer runs of its pipeline than the limit are running and its pool has a free slot (an
  undefined pool has none: the run waits, [`Store::held_back`] says why); on PostgreSQL
  `claim_task` checks again under advisory locks on the pipeline and the pool, so two claimers
  never both start a run past a limit. At admission ([`Store::admit_run`]) the pipeline's
  overflow decides what a run beyond the limit does: `queue`, `skip` (no run) or
  `cancel-previous` (the oldest live runs are cancelled). A retried limited run goes back to
  `queued` and waits for room like a new one.

# Schema

`migrations/postgres` (everything in schema `shardline`) and `migrations/sqlite`, applied by
[`Store::connect`]: `pipelines` (one row per spec version), `runs` (their [`RunOptions`] in
columns of their own, never in `params`), `tasks`, `task_deps` (edges), `attempts` (one row
per lease), `workers` (with the disk each last measured, see
[`Store::worker_heartbeat_with_disk`]), `events`, `logs` (kept for ever, no reference to
workers), `cache`, `triggers` and `trigger_firings` (see [`Store::list_triggers`] and [`Store::claim_firing`]),
`pools` (run slots shared across pipelines, see [`Store::set_pools`]), `retention_policy` and
`disk_usage` (the server's retention and what each state directory's gc measured, see
[`Store::set_retention_policy`] and [`Store::report_disk_usage`]; the step cache's use and tags
are columns of `cache`, see [`Store::cache_forget`]),
`api_tokens` (hashes of the HTTP API's tokens, see [`Store::insert_token`]), and the
notifications' targets (`run_notify_targets`, `pipeline_notify_targets`, `notify_defaults`) and
outbox (`notifications`, see [`Store::claim_notifications`]), filled by database triggers on
`runs` and `triggers` in the statement that ends a run. Every SQL
statement on these tables is in this crate. On PostgreSQL, `claim_task` and
`complete_succeeded` are plpgsql functions, so a claim and a success are one round trip each.

# Example

```no_run
# async fn demo() -> Result<(), shardline_store::StoreError> {
use std::time::Duration;
use shardline_store::*;

let store = Store::connect("sqlite::memory:").await?;
let pipeline = store.upsert_pipeline("convert", "steps: …", "sha256:…").await?;
let (run, _created) = store
    .create_run(NewRun {
        pipeline_id: pipeline,
        dedupe_key: None,
        params: serde_json::json!({}),
        spec: serde_json::json!({}),
        options: RunOptions::default(), notify: Vec::new(), submitted_by: None,
    })
    .await?;
store
    .add_tasks(run, vec![NewTask { name: "download".into(), step_id: "download".into(), kind: "hf.download".into(), ..NewTask::default() }])
    .await?;

let worker = store
    .register_worker(WorkerInfo { name: "cpu-1".into(), cpus: 8, memory: 32 << 30, gpus: vec![], scratch: 1 << 40 })
    .await?;
let free = Resources { cpus: 8, memory: 32 << 30, gpus: 0, scratch: 1 << 40 };
if let Some(lease) = store.claim(worker, &free, Duration::from_secs(60)).await? {
    // … run the task, calling store.heartbeat(&lease, ttl, progress) every ttl/3 …
    store.complete(&lease, Outcome::Succeeded { output: serde_json::json!({}) }).await?;
}
# Ok(()) }
```
*/

mod audit;
mod batch;
mod db;
mod disk;
mod error;
mod lease;
mod limits;
mod listings;
mod metrics;
mod notify;
mod open;
mod read;
mod records;
mod retention;
mod runs;
#[cfg(feature = "testing")]
pub mod testing;
mod tokens;
mod triggers;
mod types;
mod uploads;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;
use shardline_backoff::Backoff;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

pub use disk::{ScratchNeed, WorkerDisk};
pub use error::StoreError;
pub use lease::{MAX_BACKOFF, REAP_BATCH};
pub use listings::{LeasedTask, PipelineSummary, PipelineVersion};
pub use metrics::{EndedAttempt, EndedCursor, EndedPage, StateCounts};
pub use notify::{DeliveryOutcome, Notification, NotificationLease, NotifyTarget};
pub use open::{sqlite_lock_path, MIGRATE_LOCK, SQLITE_LOCK_SUFFIX};
pub use read::{MAX_LOG_LINE, MAX_PAGE};
pub use retention::{
    CacheEntry, DiskEntry, DiskKind, DiskReporter, DiskUsageRow, LiveRun, RetentionPolicy, RunRetention,
};
pub use tokens::TokenRow;
pub use triggers::{FiringClaim, FiringRecord, NewTrigger, TriggerCheck, TriggerRecord, TriggerState};
pub use types::*;
pub use uploads::{OpenUpload, UploadEnd};

use db::Pool;
use error::Result;

/// The PostgreSQL schema that holds every table of the store.
pub const PG_SCHEMA: &str = "shardline";
/// The `NOTIFY` channel that announces tasks becoming ready.
pub const PG_CHANNEL: &str = "shardline_work";
/// The embedded default: a SQLite file under `./.shardline/`.
pub const DEFAULT_SQLITE_URL: &str = "sqlite://.shardline/shardline.db";

pub(crate) static PG_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/postgres");
pub(crate) static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/sqlite");

/// How [`Store::connect_with`] sizes its pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// Pooled connections (PostgreSQL's `LISTEN` connection comes on top). By default 10 on
    /// PostgreSQL and 1 on SQLite (one writer at a time anyway; an in-memory database always
    /// has exactly one, as it lives as long as its connection).
    pub max_connections: Option<u32>,
    /// How long a call waits for a pooled connection before failing with a transient error.
    /// By default 30 s.
    pub acquire_timeout: Duration,
    /// How long opening waits for another process that is creating or migrating the same store
    /// (it holds the migration lock) before failing with [`StoreError::MigrationLocked`].
    /// By default 5 minutes.
    pub migrate_wait: Duration,
}

impl Default for StoreOptions {
    fn default() -> StoreOptions {
        StoreOptions {
            max_connections: None,
            acquire_timeout: Duration::from_secs(30),
            migrate_wait: Duration::from_secs(300),
        }
    }
}

/// The job store. Cheap to clone: clones share the pool and the wake-up listener.
pub struct Store {
    inner: Arc<Inner>,
    /// The wake-up generation this handle last looked at (see [`Store::wait_for_work`]).
    seen: AtomicU64,
}

impl Clone for Store {
    fn clone(&self) -> Store {
        Store { inner: Arc::clone(&self.inner), seen: AtomicU64::new(self.inner.wake.generation()) }
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("backend", &self.backend()).finish_non_exhaustive()
    }
}

struct Inner {
    pool: Pool,
    /// PostgreSQL: how to open the dedicated `LISTEN` connection (outside the pool).
    listen_options: Option<PgConnectOptions>,
    wake: Arc<Wake>,
    listener: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Ok(mut slot) = self.listener.lock() {
            if let Some(handle) = slot.take() {
                handle.abort();
            }
        }
    }
}

/// Wake-ups for idle workers: a generation counter bumped on every notification, so a waiter
/// can tell that something happened since it last looked, and a `Notify` to wake it.
#[derive(Default)]
struct Wake {
    generation: AtomicU64,
    notify: Notify,
    listener_connects: AtomicU64,
}

impl Wake {
    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn bump(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.notify.notify_waiters();
    }
}

impl Store {
    /// Connects to `postgres://…`/`postgresql://…`, `sqlite://PATH` (created with its parent
    /// directory when missing) or `sqlite::memory:`, and applies the embedded migrations.
    /// Any number of processes may do so at once, on a new store or an old one: one of them
    /// creates and migrates it under a lock while the others wait for it (see the `open` module:
    /// `<database>.lock` next to a SQLite file, an advisory lock on PostgreSQL).
    pub async fn connect(url: &str) -> Result<Store, StoreError> {
        Store::connect_with(url, StoreOptions::default()).await
    }

    /// [`Store::connect`] with pool options.
    pub async fn connect_with(url: &str, options: StoreOptions) -> Result<Store, StoreError> {
        let (pool, listen_options) = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let (pool, opts) = open::connect_pg(url, &options).await?;
            (Pool::Pg(pool), Some(opts))
        } else if url.starts_with("sqlite:") {
            (Pool::Lite(open::connect_sqlite(url, &options).await?), None)
        } else {
            return Err(StoreError::UnsupportedUrl(redact_url(url)));
        };
        let inner = Inner { pool, listen_options, wake: Arc::new(Wake::default()), listener: Mutex::new(None) };
        Ok(Store { inner: Arc::new(inner), seen: AtomicU64::new(0) })
    }

    /// Which database this store talks to.
    pub fn backend(&self) -> Backend {
        self.inner.pool.backend()
    }

    /// Closes the pool (and stops the listener): later calls fail.
    pub async fn close(&self) {
        if let Ok(mut slot) = self.inner.listener.lock() {
            if let Some(handle) = slot.take() {
                handle.abort();
            }
        }
        self.inner.pool.close().await;
    }

    /// Waits until tasks may have become ready, or about `timeout` (jittered down by up to a
    /// quarter, so idle pollers do not fall into step). Returns at once when a wake-up came since
    /// this handle's last `claim`, so a notification racing a fruitless claim is not lost.
    ///
    /// PostgreSQL: `LISTEN` on a dedicated connection, opened on first use and reopened with
    /// backoff whenever it drops (every reconnect counts as a wake-up, since notifications sent
    /// meanwhile are lost). SQLite: wake-ups from this process only; other processes sharing
    /// the file are seen by polling.
    pub async fn wait_for_work(&self, timeout: Duration) {
        if let Some(opts) = &self.inner.listen_options {
            self.ensure_listener(opts);
        }
        let wake = &self.inner.wake;
        let notified = wake.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let now = wake.generation();
        if now != self.seen.load(Ordering::Acquire) {
            self.seen.store(now, Ordering::Release);
            return;
        }
        let jitter = rand::rng().random_range(0.75..=1.0);
        tokio::select! {
            () = &mut notified => {}
            () = tokio::time::sleep(timeout.mul_f64(jitter)) => {}
        }
        self.seen.store(wake.generation(), Ordering::Release);
    }

    /// How many times the PostgreSQL `LISTEN` connection was (re)established (0 on SQLite or
    /// before the first `wait_for_work`).
    pub fn listener_connects(&self) -> u64 {
        self.inner.wake.listener_connects.load(Ordering::Acquire)
    }

    fn ensure_listener(&self, opts: &PgConnectOptions) {
        let Ok(mut slot) = self.inner.listener.lock() else {
            return;
        };
        if slot.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        // Its own one-connection pool: the listener never takes a connection from the store's.
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(opts.clone());
        let wake = Arc::clone(&self.inner.wake);
        *slot = Some(tokio::spawn(listen(pool, wake)));
    }

    pub(crate) fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// Records the wake-up generation at the start of a claim (see `wait_for_work`).
    pub(crate) fn mark_seen(&self) {
        self.seen.store(self.inner.wake.generation(), Ordering::Release);
    }

    /// Wakes this process's waiters (PostgreSQL waiters elsewhere get the `NOTIFY`).
    pub(crate) fn wake_local(&self) {
        self.inner.wake.bump();
    }

    /// Runs an idempotent operation, again when the database rolled it back to resolve a
    /// deadlock or serialization conflict, and again when its connection turned out dead (a
    /// pooled connection that outlived a server restart fails on first use): a repeat of an
    /// idempotent operation is harmless even if the first try did commit.
    pub(crate) async fn retrying<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        self.retry_loop(op, true, f).await
    }

    /// Runs an operation that must not be repeated once it may have committed: again only
    /// when the database rolled it back (deadlock, serialization conflict).
    pub(crate) async fn retrying_conflicts<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        self.retry_loop(op, false, f).await
    }

    async fn retry_loop<T, F, Fut>(&self, op: &'static str, idempotent: bool, mut f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let mut tries = 0u32;
        loop {
            match f().await {
                Err(e) if tries < 10 && (e.is_rollback_conflict() || (idempotent && e.is_connection_lost())) => {
                    tries += 1;
                    tracing::debug!(op, tries, error = %e, "retrying");
                    let ms = rand::rng().random_range(5..=25u64) * u64::from(tries);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                other => return other.map_err(|e| e.op(op)),
            }
        }
    }
}

async fn listen(pool: PgPool, wake: Arc<Wake>) {
    // Reconnects back off from 50 ms to 2 s, without jitter: one listener per process.
    let backoff = Backoff { base: Duration::from_millis(50), cap: Duration::from_secs(2), spread: (1.0, 1.0) };
    let mut failures = 0;
    loop {
        match PgListener::connect_with(&pool).await {
            Ok(mut listener) => match listener.listen(PG_CHANNEL).await {
                Ok(()) => {
                    failures = 0;
                    wake.listener_connects.fetch_add(1, Ordering::AcqRel);
                    // Whatever was sent while we were not listening is lost: let waiters poll.
                    wake.bump();
                    loop {
                        match listener.try_recv().await {
                            Ok(Some(_)) => wake.bump(),
                            Ok(None) => {
                                tracing::debug!("LISTEN connection lost; reopening");
                                break;
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "LISTEN connection failed; reopening");
                                break;
                            }
                        }
                    }
                    wake.bump();
                }
                Err(e) => tracing::warn!(error = %e, "cannot LISTEN on {PG_CHANNEL}"),
            },
            Err(e) => tracing::debug!(error = %e, "cannot open the LISTEN connection"),
        }
        failures += 1;
        tokio::time::sleep(backoff.delay(failures, 0.0)).await;
    }
}

/// A database URL fit to print: the password of its user info replaced by `***`
/// (`postgres://user:***@host/db`). Every message that names a store's URL goes through it.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    match authority.rfind('@') {
        Some(at) => match authority[..at].find(':') {
            Some(colon) => format!("{}{}:***{}", &url[..scheme_end + 3], &authority[..colon], &rest[at..]),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("postgres://postgres:secret@127.0.0.1:5432/db"),
            "postgres://postgres:***@127.0.0.1:5432/db"
        );
        assert_eq!(redact_url("postgres://127.0.0.1/db"), "postgres://127.0.0.1/db");
        assert_eq!(redact_url("sqlite::memory:"), "sqlite::memory:");
        // An `@` after the host (in a query) is not user info.
        assert_eq!(redact_url("postgres://h/db?application_name=a@b"), "postgres://h/db?application_name=a@b");
    }
}
