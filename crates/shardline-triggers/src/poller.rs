//! The async shell: registration, one pass over the due triggers, and the loop a server runs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, SubsecRound, Utc};
use serde_json::{json, Value};
use shardline_backoff::random_unit;
use shardline_control::{parse_pipeline, submit, Submission, SubmitError};
use shardline_hub::{HubClient, HubError, ModelListing, RevisionCheck};
use shardline_spec::{Trigger, TriggerContext, TriggerKind, Watch, WatchTarget};
use shardline_store::{FiringClaim, NewTrigger, RunId, Store, TriggerCheck, TriggerRecord, TriggerState};
use tokio::sync::watch;

use crate::decide::{author_changes, backoff, is_due, schedule_key, watch_key, CompiledSchedule, NameFilter};
use crate::{Clock, TriggerError};

/// A pipeline spec with triggers, as a server loaded it.
#[derive(Clone, Debug)]
pub struct PipelineSource {
    pub name: String,
    /// The file name runs and diagnostics name.
    pub file: String,
    pub text: String,
    pub triggers: Vec<Trigger>,
    /// Where its trigger errors are sent (the spec's `notify:`, as the store keeps it).
    pub notify: Vec<shardline_store::NotifyTarget>,
}

impl PipelineSource {
    /// Lints a spec (as `submit` does); an error renders every diagnostic.
    pub fn parse(file: &str, text: &str, base_dir: &Path) -> Result<PipelineSource, TriggerError> {
        let p = parse_pipeline(file, text, base_dir).map_err(|e| TriggerError::Invalid(e.to_string()))?;
        Ok(PipelineSource {
            name: p.name.clone(),
            file: file.to_string(),
            text: text.to_string(),
            triggers: p.triggers,
            notify: shardline_control::notify_targets(&p.notify),
        })
    }
}

/// The pipelines with triggers among the `*.yaml`/`*.yml` files of `dir`, by file name. Any
/// file that does not lint, or two files with one pipeline name, is an error naming them all.
pub fn load_dir(dir: &Path, base_dir: &Path) -> Result<Vec<PipelineSource>, TriggerError> {
    let io = |source| TriggerError::Io { path: dir.to_path_buf(), source };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    let mut out: Vec<PipelineSource> = Vec::new();
    let mut problems = Vec::new();
    for path in files {
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(source) => return Err(TriggerError::Io { path, source }),
        };
        match PipelineSource::parse(&path.display().to_string(), &text, base_dir) {
            Ok(p) if p.triggers.is_empty() => {}
            Ok(p) => {
                if let Some(other) = out.iter().find(|o| o.name == p.name) {
                    problems.push(format!("{} and {} both define pipeline `{}`", other.file, p.file, p.name));
                } else {
                    out.push(p);
                }
            }
            Err(e) => problems.push(e.to_string()),
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(TriggerError::Invalid(problems.join("\n")))
    }
}

/// How a poller submits runs and paces itself.
#[derive(Clone, Debug)]
pub struct PollerOptions {
    /// Directory relative spec paths are resolved against (as `submit`'s working directory).
    pub base_dir: PathBuf,
    /// Root of run work directories.
    pub work_dir: PathBuf,
    /// A claimed firing with no run after this long is taken over (its server died).
    pub stale_claim: Duration,
    /// The longest the loop sleeps between passes.
    pub max_sleep: Duration,
    /// Where the specs' runs may read and write (the server's path policy); `None`: anywhere.
    pub policy: Option<Arc<shardline_spec::policy::PathPolicy>>,
    /// The object-store artifact store fired runs use (`None`: `work_dir`).
    pub artifacts: Option<String>,
}

impl PollerOptions {
    pub fn new(base_dir: impl Into<PathBuf>, work_dir: impl Into<PathBuf>) -> PollerOptions {
        PollerOptions {
            base_dir: base_dir.into(),
            work_dir: work_dir.into(),
            stale_claim: Duration::from_secs(600),
            max_sleep: Duration::from_secs(15),
            artifacts: None,
            policy: None,
        }
    }
}

/// A run a trigger started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fired {
    pub pipeline: String,
    pub trigger_id: i64,
    pub dedupe_key: String,
    pub run: RunId,
    /// Watches: the repository and commit.
    pub repo: Option<String>,
    pub sha: Option<String>,
    /// Schedules: the instant.
    pub instant: Option<DateTime<Utc>>,
    /// A schedule's catch-up of a missed instant.
    pub late: bool,
}

/// What one pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Triggers that were due and checked.
    pub checked: usize,
    /// Runs started by this poller.
    pub fired: Vec<Fired>,
    /// Failed checks: the trigger's summary and the error.
    pub errors: Vec<(String, String)>,
    /// The earliest time a trigger of this poller is due next.
    pub next_due: Option<DateTime<Utc>>,
}

/// The outcome of trying to fire.
enum Fire {
    Started(Fired),
    /// Another server (or an earlier check) started it.
    Done,
    /// Another server claimed it and has not recorded a run yet.
    Pending,
}

/// Checks the triggers of some pipelines and starts their runs.
pub struct Poller {
    store: Store,
    hub: HubClient,
    clock: Arc<dyn Clock>,
    pipelines: Vec<PipelineSource>,
    opts: PollerOptions,
    observer: Option<TickObserver>,
}

/// Called with every pass [`Poller::run`] makes (the server counts checks and errors with it).
pub type TickObserver = Arc<dyn Fn(&TickReport) + Send + Sync>;

impl Poller {
    pub fn new(
        store: Store,
        hub: HubClient,
        clock: Arc<dyn Clock>,
        pipelines: Vec<PipelineSource>,
        opts: PollerOptions,
    ) -> Poller {
        Poller { store, hub, clock, pipelines, opts, observer: None }
    }

    /// Calls `observer` with the report of every pass [`Poller::run`] makes.
    pub fn with_observer(mut self, observer: TickObserver) -> Poller {
        self.observer = Some(observer);
        self
    }

    /// The pipelines this poller serves.
    pub fn pipelines(&self) -> &[PipelineSource] {
        &self.pipelines
    }

    /// Registers every pipeline's triggers in the store (idempotent; unchanged triggers keep
    /// their state) and returns the rows.
    pub async fn register(&self) -> Result<Vec<TriggerRecord>, TriggerError> {
        let mut out = Vec::new();
        for p in &self.pipelines {
            let new: Vec<NewTrigger> = p
                .triggers
                .iter()
                .map(|t| NewTrigger {
                    position: u32::try_from(t.index).unwrap_or(u32::MAX),
                    kind: t.kind_name().to_string(),
                    spec: spec_json(t),
                    summary: t.to_string(),
                })
                .collect();
            out.extend(self.store.register_triggers(&p.name, &new).await?);
            self.store.set_pipeline_notify_targets(&p.name, &p.notify).await?;
        }
        Ok(out)
    }

    /// One pass: checks every due trigger of this poller's pipelines once.
    pub async fn tick(&self) -> Result<TickReport, TriggerError> {
        let mut report = TickReport::default();
        let mut rows = self.store.list_triggers().await?;
        let missing = self.pipelines.iter().any(|p| {
            p.triggers.iter().any(|t| !rows.iter().any(|r| r.pipeline == p.name && r.position as usize == t.index))
        });
        if missing {
            self.register().await?;
            rows = self.store.list_triggers().await?;
        }
        for p in &self.pipelines {
            for t in &p.triggers {
                let Some(row) = rows.iter().find(|r| r.pipeline == p.name && r.position as usize == t.index) else {
                    continue;
                };
                if row.spec != spec_json(t) {
                    tracing::warn!(
                        pipeline = %p.name,
                        position = t.index,
                        "the store holds another version of this trigger (another server loaded a different spec); skipped"
                    );
                    continue;
                }
                let next = match &t.kind {
                    TriggerKind::Schedule(s) => self.check_schedule(row, p, t, s, &mut report).await,
                    TriggerKind::Watch(w) => self.check_watch(row, p, t, w, &mut report).await,
                };
                match next {
                    Ok(Some(at)) => report.next_due = Some(report.next_due.map_or(at, |d| d.min(at))),
                    Ok(None) => {}
                    Err(e) => report.errors.push((row.summary.clone(), e.to_string())),
                }
            }
        }
        Ok(report)
    }

    /// Registers, then ticks until `shutdown` turns true, sleeping until the next trigger is
    /// due (at most [`PollerOptions::max_sleep`]). Errors are logged and retried.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let mut registered = false;
        loop {
            let mut sleep = self.opts.max_sleep;
            if !registered {
                match self.register().await {
                    Ok(_) => registered = true,
                    Err(e) => tracing::warn!("registering triggers failed (will retry): {e}"),
                }
            }
            if registered {
                // A shutdown does not wait for a slow Hub: a tick cut between a claim and its
                // run leaves a claim that goes stale and is taken over (the run's dedupe key
                // finds a run that was created meanwhile).
                let ticked = tokio::select! {
                    r = self.tick() => r,
                    r = shutdown.changed() => {
                        if r.is_err() || *shutdown.borrow() {
                            return;
                        }
                        continue;
                    }
                };
                match ticked {
                    Ok(r) => {
                        if let Some(observe) = &self.observer {
                            observe(&r);
                        }
                        for f in &r.fired {
                            tracing::info!(pipeline = %f.pipeline, run = %f.run, key = %f.dedupe_key, "trigger started a run");
                        }
                        for (t, e) in &r.errors {
                            tracing::warn!(trigger = %t, "trigger check failed: {e}");
                        }
                        if let Some(at) = r.next_due {
                            let wait = (at - self.clock.now()).to_std().unwrap_or(Duration::ZERO);
                            sleep = wait.clamp(Duration::from_millis(200), self.opts.max_sleep);
                        }
                    }
                    Err(e) => tracing::warn!("checking triggers failed (will retry): {e}"),
                }
            }
            tokio::select! {
                () = tokio::time::sleep(sleep) => {}
                r = shutdown.changed() => {
                    if r.is_err() || *shutdown.borrow() {
                        return;
                    }
                }
            }
        }
    }

    /// A schedule: fires the instant [`CompiledSchedule::decide`] picks. Returns when it is due next.
    async fn check_schedule(
        &self,
        row: &TriggerRecord,
        p: &PipelineSource,
        t: &Trigger,
        s: &shardline_spec::Schedule,
        report: &mut TickReport,
    ) -> Result<Option<DateTime<Utc>>, TriggerError> {
        let now = self.clock.now();
        let retry_at = row.state.retry_at;
        if row.next_at.is_some() && !is_due(row.next_at, now) {
            return Ok(row.next_at);
        }
        if retry_at.is_some_and(|r| now < r) {
            return Ok(retry_at);
        }
        report.checked += 1;
        let sched = CompiledSchedule::new(s)?;
        let d = sched.decide(row.next_at, now);
        if let Some(instant) = d.fire {
            let key = schedule_key(&p.name, instant);
            let ctx = TriggerContext { time: rfc3339(instant), ..TriggerContext::default() };
            let detail = json!({ "instant": rfc3339(instant), "late": d.late });
            match self.fire(row, p, t, &key, &detail, &ctx, now).await {
                Ok(Fire::Started(mut f)) => {
                    f.instant = Some(instant);
                    f.late = d.late;
                    report.fired.push(f);
                }
                Ok(Fire::Done) => {}
                // Keep `next_at`: the next pass looks again once the other server recorded its run.
                Ok(Fire::Pending) => return Ok(row.next_at),
                Err(e) => {
                    let wait = backoff(Duration::from_secs(60), row.errors + 1, random_unit());
                    // Whole seconds, as the state has always recorded it.
                    let retry = (now + chrono::Duration::from_std(wait).unwrap_or_default()).trunc_subsecs(0);
                    let check = TriggerCheck {
                        checked_at: now,
                        next_at: row.next_at,
                        last_sha: None,
                        state: Some(TriggerState { retry_at: Some(retry), ..TriggerState::default() }),
                        error: Some(e.to_string()),
                    };
                    self.store.record_trigger_check(row.id, &check).await?;
                    return Err(e);
                }
            }
        }
        let check = TriggerCheck {
            checked_at: now,
            next_at: d.next_at,
            last_sha: None,
            state: Some(TriggerState::default()),
            error: None,
        };
        self.store.record_trigger_check(row.id, &check).await?;
        Ok(d.next_at)
    }

    /// A watch: polls the Hub and fires for new commits. Returns when it is due next.
    async fn check_watch(
        &self,
        row: &TriggerRecord,
        p: &PipelineSource,
        t: &Trigger,
        w: &Watch,
        report: &mut TickReport,
    ) -> Result<Option<DateTime<Utc>>, TriggerError> {
        let now = self.clock.now();
        if !is_due(row.next_at, now) {
            return Ok(row.next_at);
        }
        report.checked += 1;
        let polled = match &w.target {
            WatchTarget::Repo(repo) => self.poll_repo(row, p, t, w, repo, now, report).await,
            WatchTarget::Author { author, name } => self.poll_author(row, p, t, w, author, name, now, report).await,
        };
        let (check, result) = match polled {
            Ok(outcome) => {
                let next = now + chrono::Duration::from_std(w.every()).unwrap_or_default();
                let check = TriggerCheck {
                    checked_at: now,
                    next_at: Some(next),
                    last_sha: outcome.last_sha,
                    state: outcome.state,
                    error: outcome.error.clone(),
                };
                (check, outcome.error.map_or(Ok(()), |e| Err(TriggerError::Invalid(e))))
            }
            Err(e) => {
                let wait = backoff(w.every(), row.errors + 1, random_unit());
                let next = now + chrono::Duration::from_std(wait).unwrap_or_default();
                let check = TriggerCheck {
                    checked_at: now,
                    next_at: Some(next),
                    last_sha: None,
                    state: None,
                    error: Some(e.to_string()),
                };
                (check, Err(e))
            }
        };
        self.store.record_trigger_check(row.id, &check).await?;
        result.map(|()| check.next_at)
    }

    #[allow(clippy::too_many_arguments)]
    async fn poll_repo(
        &self,
        row: &TriggerRecord,
        p: &PipelineSource,
        t: &Trigger,
        w: &Watch,
        repo: &str,
        now: DateTime<Utc>,
        report: &mut TickReport,
    ) -> Result<Polled, TriggerError> {
        // `If-None-Match` with the revision's last ETag (or the last sha, which is the ETag
        // some servers send): an unchanged revision is a 304.
        let etag = row.state.etag.clone().or_else(|| row.last_sha.as_ref().map(|s| format!("\"{s}\"")));
        let (sha, etag) = match self.hub.revision_if_changed(repo, &w.revision, etag.as_deref()).await? {
            RevisionCheck::Unchanged => return Ok(Polled::default()),
            RevisionCheck::Changed { sha, etag } => (sha, etag),
        };
        let state = Some(TriggerState { etag, ..TriggerState::default() });
        if row.last_sha.as_deref() == Some(sha.as_str()) {
            return Ok(Polled { state, ..Polled::default() });
        }
        match self.fire_watch(row, p, t, w, repo, &sha, now).await? {
            Fire::Started(f) => {
                report.fired.push(f);
                Ok(Polled { last_sha: Some(sha), state, ..Polled::default() })
            }
            Fire::Done => Ok(Polled { last_sha: Some(sha), state, ..Polled::default() }),
            // Not remembered: the next poll sees the sha as new and finds the recorded run.
            Fire::Pending => Ok(Polled::default()),
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn poll_author(
        &self,
        row: &TriggerRecord,
        p: &PipelineSource,
        t: &Trigger,
        w: &Watch,
        author: &str,
        name: &str,
        now: DateTime<Utc>,
        report: &mut TickReport,
    ) -> Result<Polled, TriggerError> {
        let filter = NameFilter::new(author, name)?;
        let seen = row.state.seen.as_ref();
        // The listing's ETag says whether the heads of `main` changed; other revisions are
        // asked per repository.
        let etag = match (&seen, w.revision == "main") {
            (Some(_), true) => row.state.etag.as_deref(),
            _ => None,
        };
        let (models, listing_etag) = match self.hub.list_models_if_changed(Some(author), None, etag).await? {
            ModelListing::Unchanged => return Ok(Polled::default()),
            ModelListing::Changed { models, etag } => (models, etag),
        };
        let mut current = BTreeMap::new();
        for m in models.into_iter().filter(|m| filter.matches(&m.id)) {
            // The listing's sha is the default branch's head; another revision is asked for.
            let listed = if w.revision == "main" { m.sha.clone() } else { None };
            let sha = match listed {
                Some(s) => s,
                None => match self.hub.head_sha(&m.id, &w.revision, None).await {
                    Ok(Some(s)) => s,
                    Ok(None) => continue,
                    // A repository without that revision is not watched (yet).
                    Err(HubError::RevisionNotFound { .. }) => continue,
                    Err(e) => return Err(e.into()),
                },
            };
            current.insert(m.id, sha);
        }
        let mut remember = current.clone();
        let mut complete = true;
        let mut last_sha = None;
        let mut errors = Vec::new();
        for (repo, sha) in author_changes(seen, &current) {
            let outcome = self.fire_watch(row, p, t, w, &repo, &sha, now).await;
            match outcome {
                Ok(Fire::Started(f)) => {
                    report.fired.push(f);
                    last_sha = Some(sha);
                }
                Ok(Fire::Done) => {}
                Ok(Fire::Pending) | Err(_) => {
                    // Not remembered (and the listing asked for in full), so the next poll
                    // tries again.
                    complete = false;
                    match seen.and_then(|s| s.get(&repo)) {
                        Some(old) => remember.insert(repo.clone(), old.clone()),
                        None => remember.remove(&repo),
                    };
                    if let Err(e) = outcome {
                        errors.push(format!("{repo}@{sha}: {e}"));
                    }
                }
            }
        }
        let etag = listing_etag.filter(|_| complete && w.revision == "main");
        Ok(Polled {
            last_sha,
            state: Some(TriggerState { seen: Some(remember), etag, ..TriggerState::default() }),
            error: (!errors.is_empty()).then(|| errors.join("; ")),
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn fire_watch(
        &self,
        row: &TriggerRecord,
        p: &PipelineSource,
        t: &Trigger,
        w: &Watch,
        repo: &str,
        sha: &str,
        now: DateTime<Utc>,
    ) -> Result<Fire, TriggerError> {
        let key = watch_key(&p.name, repo, sha);
        let ctx = TriggerContext {
            repo: Some(repo.to_string()),
            sha: Some(sha.to_string()),
            revision: Some(w.revision.clone()),
            time: rfc3339(now),
        };
        let detail = json!({ "repo": repo, "sha": sha, "revision": w.revision });
        let fire = self.fire(row, p, t, &key, &detail, &ctx, now).await?;
        Ok(match fire {
            Fire::Started(mut f) => {
                f.repo = Some(repo.to_string());
                f.sha = Some(sha.to_string());
                Fire::Started(f)
            }
            other => other,
        })
    }

    /// Claims the firing `key`; the claimant submits the run (with `key` as its dedupe key) and
    /// records it. A failed submission releases the claim.
    #[allow(clippy::too_many_arguments)]
    async fn fire(
        &self,
        row: &TriggerRecord,
        p: &PipelineSource,
        t: &Trigger,
        key: &str,
        detail: &Value,
        ctx: &TriggerContext,
        now: DateTime<Utc>,
    ) -> Result<Fire, TriggerError> {
        match self.store.claim_firing(row.id, key, detail, now, self.opts.stale_claim).await? {
            FiringClaim::Taken { run: Some(_) } => return Ok(Fire::Done),
            FiringClaim::Taken { run: None } => return Ok(Fire::Pending),
            FiringClaim::Skipped => return Ok(Fire::Done),
            FiringClaim::Claimed => {}
        }
        let overrides = t.overrides(ctx);
        let submitted = submit(
            &self.store,
            Submission {
                file: &p.file,
                text: &p.text,
                overrides: &overrides,
                base_dir: &self.opts.base_dir,
                work_dir: &self.opts.work_dir,
                dedupe_key: Some(key.to_string()),
                no_cache: false,
                policy: self.opts.policy.as_deref(),
                priority: None,
                submitted_by: Some(shardline_control::actor::trigger(&p.name, row.position)),
                artifacts: self.opts.artifacts.as_deref(),
            },
        )
        .await;
        let s = match submitted {
            Ok(s) => s,
            Err(SubmitError::Skipped(skipped)) => {
                // Not an error: the pipeline asked for it (a nightly still running when the
                // next fires). The firing is done and says why.
                let reason = skipped.to_string();
                tracing::info!(pipeline = %p.name, key, "{reason}");
                self.store.skip_firing(key, &reason, now).await?;
                return Ok(Fire::Done);
            }
            Err(e) => {
                if let Err(release) = self.store.release_firing(key).await {
                    tracing::warn!(key, "releasing a failed firing failed (it goes stale instead): {release}");
                }
                return Err(TriggerError::Submit(e.to_string()));
            }
        };
        self.store.complete_firing(row.id, key, s.run, now).await?;
        Ok(Fire::Started(Fired {
            pipeline: p.name.clone(),
            trigger_id: row.id,
            dedupe_key: key.to_string(),
            run: s.run,
            repo: None,
            sha: None,
            instant: None,
            late: false,
        }))
    }
}

/// What a good poll changes.
#[derive(Default)]
struct Polled {
    last_sha: Option<String>,
    state: Option<TriggerState>,
    /// Some firings failed (the poll itself succeeded).
    error: Option<String>,
}

fn spec_json(t: &Trigger) -> Value {
    serde_json::to_value(t).unwrap_or(Value::Null)
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}
