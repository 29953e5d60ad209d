/*!
Triggers start pipeline runs without a `submit`: a `schedule:` fires at the instants of a cron
expression in a named time zone, a `watch:` polls the Hugging Face Hub and fires when a
repository (or any of an author's repositories whose name matches a glob) has a new commit at a
revision. The spec side (`triggers:` in a pipeline file, lint) lives in `shardline-spec`.

**Owns:** when runs start on their own. **Must not depend on:** the engine, the data plane or
the HTTP API: runs are submitted through `shardline-control`, state kept by `shardline-store`,
the Hub asked through `shardline-hub`.

Two layers:

- [`decide`] is the pure core: given a trigger's settings, what it remembers and "now" (from an
  injectable [`Clock`]), what fires and when it is due next, the missed-run policy, the backoff
  after errors and the dedupe keys. No I/O.
- [`Poller`] is the thin async shell: it registers the triggers of the pipelines it was given in
  the store, and on each [`Poller::tick`] checks the due ones — a watch asks the Hub through
  `shardline-hub` (`If-None-Match` with the last sha, so an unchanged revision is a 304; author
  listings through `GET /api/models?author=…`), with exponential backoff and jitter after
  errors — and fires runs through the engine's submission.

# Invariants

- **One run per pipeline + repo + sha** (and per pipeline + scheduled instant). A firing is first
  claimed in the store under its dedupe key (`trigger_firings`, primary key), and only the
  claimant submits, with the same key as the run's dedupe key. Several servers polling the same
  repository, a restarted server, or a repeated check all find the claim and start nothing.
  A claim whose server died before recording the run goes stale after
  [`PollerOptions::stale_claim`] and is taken over; a failed submission releases its claim.
- **State is in the store**, not in memory: the next firing, the last sha seen, ETags and an
  author listing's shas survive restarts and are shared by servers.
- **Time comes from the [`Clock`]**, never from the database, so tests drive days and DST changes.

# Decisions

- A repository watch fires for the commit it first sees (the current release gets converted);
  an author watch takes its first listing as a baseline and fires only for repositories that
  appear or change afterwards (an author may have hundreds).
- A schedule registered for the first time owes nothing: it is due at the next instant.
- A firing's run that fails is not started again by the trigger (its key stays fired); retry it
  with `shardline retry`. A submission the engine refuses releases the claim and is retried at
  the next check, with backoff.
- Missed instants (`missed:`): at most one run catches up, for the latest instant (`run-once`,
  the default) or none (`skip`); an instant fired at most 5 minutes late is on time.
*/

pub mod clock;
pub mod decide;
mod poller;

use std::path::PathBuf;

pub use clock::{Clock, ManualClock, SystemClock};
pub use decide::{backoff, schedule_key, watch_key, CompiledSchedule, NameFilter, ScheduleDecision};
pub use poller::{load_dir, Fired, PipelineSource, Poller, PollerOptions, TickObserver, TickReport};

/// What can go wrong loading pipelines or checking triggers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TriggerError {
    /// A spec or a trigger setting that cannot work.
    #[error("{0}")]
    Invalid(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] shardline_store::StoreError),
    #[error(transparent)]
    Hub(#[from] shardline_hub::HubError),
    /// The engine refused the run (the spec or the trigger's params do not instantiate).
    #[error("submitting the run failed: {0}")]
    Submit(String),
}
