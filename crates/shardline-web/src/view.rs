//! What the dashboard shows beyond the stored rows, computed from them: a run's model and
//! revision, a task's rate and ETA, why a task waits, and the step graph with fan-out counts.
//! Pure functions of rows and a clock, so they are tested without a database.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::Value;
use shardline_control::graph::Payload;
use shardline_control::{TaskOutput, TaskProgress};
use shardline_spec::PipelineOutline;
use shardline_store::{HeldBack, Resources, RunId, RunRow, TaskDep, TaskRow, TaskState, WorkerRow, WorkerState};

use crate::dto::{ProgressDto, StepDto, TaskCountsDto};

/// A worker whose last heartbeat is older than this is taken as gone when explaining waits.
pub const WORKER_GONE_AFTER_SECS: i64 = 120;

/// The model (Hub repository or local path) and revision the run's `hf.download` step reads.
pub fn model_of(spec: &Value) -> (Option<String>, Option<String>) {
    for step in PipelineOutline::from_value(spec).steps {
        let Some(source) = step.download_source() else { continue };
        let model = source.repo.clone().or_else(|| source.path.clone());
        if model.is_some() {
            return (model, source.revision.clone());
        }
    }
    (None, None)
}

/// Milliseconds from start to finish, or to `now` while running.
pub fn duration_ms(run: &RunRow, now: DateTime<Utc>) -> Option<i64> {
    let start = run.started_at?;
    Some((run.finished_at.unwrap_or(now) - start).num_milliseconds().max(0))
}

/// The bytes a task is expected to move, when known: a rank task's planned bytes (from its plan
/// task's output), a validate or download task's source size.
fn expected_bytes(task: &TaskRow, outputs: &HashMap<&str, TaskOutput>) -> Option<u64> {
    match Payload::deserialize(&task.payload).ok()? {
        Payload::Rank { plan_task, rank, .. } => {
            let index = usize::try_from(rank).ok()?;
            outputs.get(plan_task.as_str())?.bytes_per_rank.as_ref()?.get(index).copied()
        }
        Payload::Validate { source_task, .. } => outputs.get(source_task.as_str())?.bytes,
        _ => None,
    }
}

/// Progress of a task: bytes so far (from its last heartbeat), the expected total when known,
/// the mean rate of the current attempt and the time left at that rate.
pub fn progress_of(task: &TaskRow, outputs: &HashMap<&str, TaskOutput>, now: DateTime<Utc>) -> Option<ProgressDto> {
    let reported = task.progress.as_ref().and_then(TaskProgress::from_value);
    // The plan's figure first; else what the task itself says it will move (a download knows
    // once it has listed the files).
    let total = expected_bytes(task, outputs).or(reported.and_then(|p| p.bytes_total));
    // A finished task moved what was planned (outputs count file bytes, headers included, where
    // progress and plans count tensor data); without a plan, what its output says.
    let done_bytes = match task.state {
        TaskState::Succeeded => total.or_else(|| {
            let o = TaskOutput::from_value(task.output.as_ref()?);
            o.bytes.or(o.bytes_checked)
        }),
        _ => None,
    };
    let bytes = done_bytes.or(reported.map(|p| p.bytes));
    if bytes.is_none() && total.is_none() {
        return None;
    }
    let bytes = bytes.unwrap_or(0);
    let mut rate = None;
    let mut eta = None;
    if task.state == TaskState::Leased {
        if let (Some(start), Some(beat)) = (task.leased_at, task.heartbeat_at.or(Some(now))) {
            let secs = (beat - start).num_milliseconds() as f64 / 1000.0;
            if secs > 0.0 && bytes > 0 {
                let r = bytes as f64 / secs;
                rate = Some(r);
                if let Some(t) = total {
                    eta = Some(t.saturating_sub(bytes) as f64 / r);
                }
            }
        }
    }
    let fraction = total.filter(|t| *t > 0).map(|t| (bytes as f64 / t as f64).clamp(0.0, 1.0));
    Some(ProgressDto { bytes, total_bytes: total, fraction, bytes_per_sec: rate, eta_seconds: eta })
}

/// A leased task's hold on a worker.
#[derive(Debug, Clone)]
pub struct Held {
    pub worker: i64,
    pub resources: Resources,
}

fn gib(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{} MiB", b >> 20)
    }
}

/// The scratch a worker has free: what it last reported of its disk (already less its reserve
/// and its leases), else its configured scratch less what its leases hold.
fn free_scratch(w: &WorkerRow, held: &[Held]) -> u64 {
    match w.disk {
        Some(d) => d.scratch_free,
        None => held
            .iter()
            .filter(|h| h.worker == w.id.0)
            .fold(w.resources.scratch, |free, h| free.saturating_sub(h.resources.scratch)),
    }
}

/// Why a ready task has not been claimed, from the workers and what their leases hold.
pub fn ready_reason(need: &Resources, workers: &[WorkerRow], held: &[Held], now: DateTime<Utc>) -> String {
    let live: Vec<&WorkerRow> = workers
        .iter()
        .filter(|w| w.state == WorkerState::Active && (now - w.last_heartbeat).num_seconds() < WORKER_GONE_AFTER_SECS)
        .collect();
    if live.is_empty() {
        return "no worker is running: start one with `shardline worker`".into();
    }
    let fitting: Vec<&&WorkerRow> = live.iter().filter(|w| w.resources.fits(need)).collect();
    if fitting.is_empty() {
        let most = |f: fn(&Resources) -> u64| live.iter().map(|w| f(&w.resources)).max().unwrap_or(0);
        let mut short = Vec::new();
        if u64::from(need.gpus) > most(|r| u64::from(r.gpus)) {
            short.push(format!("{} GPUs (most: {})", need.gpus, most(|r| u64::from(r.gpus))));
        }
        if need.memory > most(|r| r.memory) {
            short.push(format!("{} memory (most: {})", gib(need.memory), gib(most(|r| r.memory))));
        }
        if u64::from(need.cpus) > most(|r| u64::from(r.cpus)) {
            short.push(format!("{} CPUs (most: {})", need.cpus, most(|r| u64::from(r.cpus))));
        }
        if need.scratch > most(|r| r.scratch) {
            short.push(format!("{} scratch (most: {})", gib(need.scratch), gib(most(|r| r.scratch))));
        }
        return format!("no worker has enough resources: needs {}", short.join(", "));
    }
    // Scratch is what the workers' disks have free now, not what they were configured with.
    if need.scratch > 0 {
        let best = fitting.iter().map(|w| (free_scratch(w, held), w.name.as_str())).max_by_key(|(free, _)| *free);
        if let Some((most, name)) = best.filter(|(most, _)| need.scratch > *most) {
            return format!(
                "needs {} scratch; the most any live worker has free is {} (worker {name})",
                gib(need.scratch),
                gib(most)
            );
        }
    }
    let free_fits = fitting.iter().any(|w| {
        let mut free = w.resources;
        for h in held.iter().filter(|h| h.worker == w.id.0) {
            free.cpus = free.cpus.saturating_sub(h.resources.cpus);
            free.memory = free.memory.saturating_sub(h.resources.memory);
            free.gpus = free.gpus.saturating_sub(h.resources.gpus);
        }
        free.scratch = free_scratch(w, held);
        free.fits(need)
    });
    if free_fits {
        "waiting for a worker to claim it (one has room)".into()
    } else {
        format!("every worker that fits ({}) is busy with other tasks", fitting.len())
    }
}

/// Why each task is where it is (by task id): what a blocked task waits on, why a ready one is
/// not claimed — its run held back by a limit (`limits`, by run: "pipeline nightly: 1 of 1
/// running", "pool gpu-big: 2 of 2 slots in use"), else the workers —, that a succeeded one was
/// served from the step cache.
pub fn reasons(
    tasks: &[TaskRow],
    deps: &[TaskDep],
    workers: &[WorkerRow],
    held: &[Held],
    limits: &HashMap<RunId, HeldBack>,
    now: DateTime<Utc>,
) -> HashMap<i64, String> {
    let by_id: HashMap<i64, &TaskRow> = tasks.iter().map(|t| (t.id.0, t)).collect();
    let mut needs: HashMap<i64, Vec<i64>> = HashMap::new();
    for d in deps {
        needs.entry(d.task.0).or_default().push(d.needs.0);
    }
    let mut out = HashMap::new();
    // Resource reasons depend only on the need: compute each distinct one once.
    let mut ready_cache: HashMap<(u32, u64, u32, u64), String> = HashMap::new();
    for t in tasks {
        let reason = match t.state {
            TaskState::Blocked => {
                let mut waiting: BTreeMap<&str, usize> = BTreeMap::new();
                for n in needs.get(&t.id.0).into_iter().flatten() {
                    if let Some(dep) = by_id.get(n).filter(|d| d.state != TaskState::Succeeded) {
                        *waiting.entry(dep.step_id.as_str()).or_default() += 1;
                    }
                }
                if waiting.is_empty() {
                    Some("waiting to be made ready".to_string())
                } else {
                    let parts: Vec<String> = waiting
                        .iter()
                        .map(|(s, n)| if *n == 1 { format!("step `{s}`") } else { format!("step `{s}` ({n} tasks)") })
                        .collect();
                    Some(format!("waiting on {}", parts.join(", ")))
                }
            }
            TaskState::Ready => match t.ready_at {
                Some(at) if at > now => Some(format!(
                    "retry backoff: ready in {}s",
                    ((at - now).num_milliseconds() as f64 / 1000.0).ceil() as i64
                )),
                _ if limits.contains_key(&t.run) => limits.get(&t.run).map(ToString::to_string),
                _ => {
                    let r = &t.resources;
                    let key = (r.cpus, r.memory, r.gpus, r.scratch);
                    Some(
                        ready_cache
                            .entry(key)
                            .or_insert_with(|| ready_reason(&t.resources, workers, held, now))
                            .clone(),
                    )
                }
            },
            TaskState::Succeeded if t.output.as_ref().is_some_and(|o| TaskOutput::from_value(o).is_cached()) => {
                Some("served from the step cache".to_string())
            }
            _ => None,
        };
        if let Some(r) = reason {
            out.insert(t.id.0, r);
        }
    }
    out
}

/// Outputs of succeeded tasks by task name (rank tasks read their plan task's).
pub fn outputs_by_name(tasks: &[TaskRow]) -> HashMap<&str, TaskOutput> {
    tasks
        .iter()
        .filter(|t| t.state == TaskState::Succeeded)
        .filter_map(|t| Some((t.name.as_str(), TaskOutput::from_value(t.output.as_ref()?))))
        .collect()
}

/// Counts of tasks by state.
fn count(tasks: &[&TaskRow]) -> TaskCountsDto {
    let mut c = TaskCountsDto { blocked: 0, ready: 0, leased: 0, succeeded: 0, failed: 0, cancelled: 0, total: 0 };
    for t in tasks {
        match t.state {
            TaskState::Blocked => c.blocked += 1,
            TaskState::Ready => c.ready += 1,
            TaskState::Leased => c.leased += 1,
            TaskState::Succeeded => c.succeeded += 1,
            TaskState::Failed => c.failed += 1,
            TaskState::Cancelled => c.cancelled += 1,
        }
        c.total += 1;
    }
    c
}

/// The state a step is shown in, from its tasks' counts.
fn step_state(c: &TaskCountsDto) -> &'static str {
    if c.total == 0 {
        "pending"
    } else if c.failed > 0 {
        "failed"
    } else if c.succeeded == c.total {
        "succeeded"
    } else if c.leased > 0 || c.succeeded > 0 {
        "running"
    } else if c.cancelled > 0 {
        "cancelled"
    } else if c.ready > 0 {
        "ready"
    } else {
        "blocked"
    }
}

/// The run's steps in spec order with the steps each needs, fan-out counts, state and bytes.
/// Steps come from the resolved spec; tasks of steps it does not list (or a spec that cannot be
/// read) come after, with needs taken from the task graph.
pub fn steps(spec: &Value, tasks: &[TaskRow], deps: &[TaskDep]) -> Vec<StepDto> {
    let mut order: Vec<(String, String, Vec<String>)> = Vec::new();
    for s in PipelineOutline::from_value(spec).steps {
        let kind = s.kind().unwrap_or_default().to_string();
        let Some(id) = s.id else { continue };
        order.push((id, kind, s.needs));
    }
    let step_of: HashMap<i64, &str> = tasks.iter().map(|t| (t.id.0, t.step_id.as_str())).collect();
    for t in tasks {
        if !order.iter().any(|(id, _, _)| id == &t.step_id) {
            let mut needs: Vec<String> = deps
                .iter()
                .filter(|d| step_of.get(&d.task.0) == Some(&t.step_id.as_str()))
                .filter_map(|d| step_of.get(&d.needs.0).map(|s| s.to_string()))
                .filter(|s| s != &t.step_id)
                .collect();
            needs.sort();
            needs.dedup();
            order.push((t.step_id.clone(), t.kind.clone(), needs));
        }
    }
    let outputs = outputs_by_name(tasks);
    let mut by_step: HashMap<&str, Vec<&TaskRow>> = HashMap::new();
    for t in tasks {
        by_step.entry(t.step_id.as_str()).or_default().push(t);
    }
    let now = Utc::now();
    order
        .into_iter()
        .map(|(id, kind, needs)| {
            let ts = by_step.get(id.as_str()).cloned().unwrap_or_default();
            let counts = count(&ts);
            // Bytes of the tasks with a known total (a shard step's ranks) against that total;
            // without any, what the step's tasks report.
            let progress: Vec<ProgressDto> = ts.iter().filter_map(|t| progress_of(t, &outputs, now)).collect();
            let planned = progress.iter().any(|p| p.total_bytes.is_some());
            let bytes = progress.iter().filter(|p| !planned || p.total_bytes.is_some()).map(|p| p.bytes).sum::<u64>();
            let total_bytes = progress.iter().filter_map(|p| p.total_bytes).sum::<u64>();
            let cached =
                ts.iter().filter(|t| t.output.as_ref().is_some_and(|o| TaskOutput::from_value(o).is_cached())).count()
                    as i64;
            StepDto {
                state: step_state(&counts).into(),
                id,
                kind,
                needs,
                tasks: counts,
                cached,
                bytes,
                total_bytes: (total_bytes > 0).then_some(total_bytes),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use shardline_control::graph::ShardJob;
    use shardline_store::{RunId, TaskId, WorkerDisk, WorkerId};
    use std::time::Duration;

    fn task(id: i64, name: &str, step: &str, state: TaskState) -> TaskRow {
        TaskRow {
            id: TaskId(id),
            run: RunId(1),
            name: name.into(),
            step_id: step.into(),
            kind: "k".into(),
            state,
            priority: 0,
            resources: Resources { cpus: 1, memory: 1 << 30, gpus: 0, scratch: 0 },
            payload: json!({}),
            output: None,
            progress: None,
            attempt: 0,
            attempt_base: 0,
            max_attempts: 1,
            max_lost: 10,
            lost: 0,
            backoff: Duration::ZERO,
            timeout: Duration::ZERO,
            ready_at: None,
            lease_owner: None,
            lease_token: 0,
            leased_at: None,
            lease_expires_at: None,
            heartbeat_at: None,
            cache_key: None,
            error: None,
            created_at: Utc::now(),
            finished_at: None,
        }
    }

    /// The payload of rank `rank` of the shard step `shard`.
    fn rank_payload(rank: u64) -> Value {
        let job = ShardJob { dp: 2, source_task: "download".into(), ..ShardJob::default() };
        serde_json::to_value(Payload::Rank { job, plan_task: "shard".into(), rank }).expect("payload")
    }

    fn worker(id: i64, gpus: u32, memory: u64, beat: DateTime<Utc>) -> WorkerRow {
        WorkerRow {
            id: WorkerId(id),
            name: format!("w{id}"),
            resources: Resources { cpus: 8, memory, gpus, scratch: 1 << 40 },
            gpus: (0..gpus).collect(),
            state: WorkerState::Active,
            registered_at: beat,
            last_heartbeat: beat,
            disk: None,
        }
    }

    #[test]
    fn model_and_revision_from_either_source() {
        let hub = json!({"steps": [{"id": "d", "kind": "hf.download",
            "config": {"kind": "hf.download", "repo": "org/m", "revision": "main"}}]});
        assert_eq!(model_of(&hub), (Some("org/m".into()), Some("main".into())));
        let local = json!({"steps": [{"id": "s", "kind": "megatron.shard", "config": {"kind": "megatron.shard", "tp": 2}},
            {"id": "d", "config": {"kind": "hf.download", "path": "/data/m"}}]});
        assert_eq!(model_of(&local), (Some("/data/m".into()), None));
        assert_eq!(model_of(&json!({})), (None, None));
    }

    #[test]
    fn model_and_steps_from_older_shapes() {
        // The config keyed by its kind, and no kind on the step.
        let keyed = json!({"steps": [{"id": "d", "config": {"hf.download": {"repo": "org/m", "revision": "v1"}}},
            {"id": "s", "config": {"megatron.shard": {"tp": 2}}, "needs": ["d"]}]});
        assert_eq!(model_of(&keyed), (Some("org/m".into()), Some("v1".into())));
        let s = steps(&keyed, &[], &[]);
        let shown: Vec<(&str, &str)> = s.iter().map(|s| (s.id.as_str(), s.kind.as_str())).collect();
        assert_eq!(shown, [("d", "hf.download"), ("s", "megatron.shard")]);
        assert_eq!(s[1].needs, ["d"]);
        // The kind on the step only, the config without it.
        let untagged = json!({"steps": [{"id": "d", "kind": "hf.download", "config": {"path": "/old"}}]});
        assert_eq!(model_of(&untagged), (Some("/old".into()), None));
        assert_eq!(steps(&untagged, &[], &[])[0].kind, "hf.download");
        // A download step without a source, a step without config: the next step's source counts.
        let later = json!({"steps": [{"id": "a", "kind": "hf.download", "config": {"kind": "hf.download"}},
            {"id": "b", "kind": "hf.download"},
            {"id": "c", "kind": "hf.download", "config": {"kind": "hf.download", "path": "/m", "revision": 3}}]});
        assert_eq!(model_of(&later), (Some("/m".into()), None));
        // What cannot be read is left out: a step without an id, needs that are not names.
        let odd = json!({"steps": [{"kind": "hf.download"}, 7, {"id": "x", "kind": "megatron.shard", "needs": ["d", 1]},
            {"id": 5}, {"id": "y", "needs": "d"}]});
        let s = steps(&odd, &[], &[]);
        let shown: Vec<(&str, &str, Vec<String>)> =
            s.iter().map(|s| (s.id.as_str(), s.kind.as_str(), s.needs.clone())).collect();
        assert_eq!(shown, [("x", "megatron.shard", vec!["d".to_string()]), ("y", "", vec![])]);
        // A spec that is not a pipeline: the steps come from the tasks.
        for spec in [json!(null), json!([]), json!({"steps": {"id": "d"}})] {
            assert_eq!(model_of(&spec), (None, None));
            let s = steps(&spec, &[task(1, "download", "download", TaskState::Ready)], &[]);
            assert_eq!(s.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["download"]);
        }
    }

    #[test]
    fn rank_progress_rate_and_eta() {
        let now = Utc::now();
        let mut plan = task(1, "shard", "shard", TaskState::Succeeded);
        plan.output = Some(json!({"bytes_per_rank": [1000, 4000]}));
        let mut rank = task(2, "shard/rank-1", "shard", TaskState::Leased);
        rank.payload = rank_payload(1);
        rank.progress = Some(json!({"bytes": 1000}));
        rank.leased_at = Some(now - chrono::Duration::seconds(10));
        rank.heartbeat_at = Some(now - chrono::Duration::seconds(8));
        let tasks = vec![plan, rank];
        let outputs = outputs_by_name(&tasks);
        let p = progress_of(&tasks[1], &outputs, now).expect("progress");
        assert_eq!((p.bytes, p.total_bytes), (1000, Some(4000)));
        assert_eq!(p.fraction, Some(0.25));
        let rate = p.bytes_per_sec.expect("rate");
        assert!((rate - 500.0).abs() < 1e-6, "{rate}");
        assert!((p.eta_seconds.expect("eta") - 6.0).abs() < 1e-6);
        // A finished rank moved what was planned, whatever its output counts.
        let mut done = tasks[1].clone();
        done.state = TaskState::Succeeded;
        done.output = Some(json!({"rank": 1, "bytes": 4500}));
        let p = progress_of(&done, &outputs, now).expect("progress");
        assert_eq!((p.bytes, p.total_bytes, p.fraction, p.bytes_per_sec), (4000, Some(4000), Some(1.0), None));
        // A task with nothing known has no progress.
        assert!(progress_of(&task(3, "x", "x", TaskState::Ready), &outputs, now).is_none());
    }

    #[test]
    fn a_download_reports_its_own_total() {
        let now = Utc::now();
        let mut dl = task(1, "download", "download", TaskState::Leased);
        dl.progress = Some(json!({"bytes": 3000, "bytes_total": 12000}));
        dl.leased_at = Some(now - chrono::Duration::seconds(4));
        dl.heartbeat_at = Some(now - chrono::Duration::seconds(1));
        let p = progress_of(&dl, &HashMap::new(), now).expect("progress");
        assert_eq!((p.bytes, p.total_bytes, p.fraction), (3000, Some(12000), Some(0.25)));
        assert!((p.bytes_per_sec.expect("rate") - 1000.0).abs() < 1e-6);
        assert!((p.eta_seconds.expect("eta") - 9.0).abs() < 1e-6);
    }

    #[test]
    fn why_waiting() {
        let now = Utc::now();
        let a = task(1, "a", "download", TaskState::Leased);
        let mut b = task(2, "b", "shard", TaskState::Blocked);
        let mut gpu = task(3, "g", "gpu", TaskState::Ready);
        gpu.resources.gpus = 2;
        let mut cached = task(4, "c", "shard", TaskState::Succeeded);
        cached.output = Some(json!({"cached": {"dir": "/x"}}));
        let mut backoff = task(5, "r", "upload", TaskState::Ready);
        backoff.ready_at = Some(now + chrono::Duration::seconds(30));
        b.resources.gpus = 0;
        let tasks = vec![a, b, gpu, cached, backoff];
        let deps = vec![TaskDep { task: TaskId(2), needs: TaskId(1) }];
        let workers = vec![worker(7, 1, 8 << 30, now)];
        let r = reasons(&tasks, &deps, &workers, &[], &HashMap::new(), now);
        assert_eq!(r.get(&2).map(String::as_str), Some("waiting on step `download`"));
        assert_eq!(r.get(&3).map(String::as_str), Some("no worker has enough resources: needs 2 GPUs (most: 1)"));
        assert_eq!(r.get(&4).map(String::as_str), Some("served from the step cache"));
        assert!(r.get(&5).is_some_and(|s| s.starts_with("retry backoff: ready in 3")), "{r:?}");
        assert!(!r.contains_key(&1));
        // No live worker at all; then a fitting worker that is full.
        let stale = vec![worker(7, 4, 8 << 30, now - chrono::Duration::seconds(600))];
        let r = reasons(&tasks, &deps, &stale, &[], &HashMap::new(), now);
        assert!(r[&3].starts_with("no worker is running"), "{}", r[&3]);
        let big = vec![worker(7, 2, 8 << 30, now)];
        let held = vec![Held { worker: 7, resources: Resources { cpus: 1, memory: 0, gpus: 1, scratch: 0 } }];
        assert_eq!(
            reasons(&tasks, &deps, &big, &held, &HashMap::new(), now)[&3],
            "every worker that fits (1) is busy with other tasks"
        );
        assert_eq!(
            reasons(&tasks, &deps, &big, &[], &HashMap::new(), now)[&3],
            "waiting for a worker to claim it (one has room)"
        );
        // The run is held back by its pipeline's limit, or its pool: that is the reason.
        let run = tasks[2].run;
        let limit = HeldBack::Concurrency { key: "nightly".into(), running: 1, limit: 1 };
        let r = reasons(&tasks, &deps, &big, &[], &HashMap::from([(run, limit)]), now);
        assert_eq!(r[&3], "pipeline nightly: 1 of 1 running");
        assert!(r[&5].starts_with("retry backoff"), "{}", r[&5]);
        let pool = HeldBack::Pool { name: "gpu-big".into(), in_use: 2, slots: Some(2) };
        let r = reasons(&tasks, &deps, &big, &[], &HashMap::from([(run, pool)]), now);
        assert_eq!(r[&3], "pool gpu-big: 2 of 2 slots in use");
    }

    #[test]
    fn why_waiting_names_a_scratch_shortfall() {
        let now = Utc::now();
        let mut rank = task(1, "shard/rank-0", "shard", TaskState::Ready);
        rank.resources.scratch = 12 << 30;
        let tasks = vec![rank];
        let mut small = worker(2, 0, 8 << 30, now);
        small.name = "cpu-1".into();
        small.disk = Some(WorkerDisk { free: 2 << 30, total: 100 << 30, scratch_free: 1 << 30 });
        let mut larger = worker(3, 0, 8 << 30, now);
        larger.name = "cpu-2".into();
        larger.disk = Some(WorkerDisk { free: 4 << 30, total: 100 << 30, scratch_free: 3_328_599_654 });
        // A worker with more free but gone silent does not count.
        let mut gone = worker(4, 0, 8 << 30, now - chrono::Duration::seconds(600));
        gone.disk = Some(WorkerDisk { free: 1 << 40, total: 2 << 40, scratch_free: 1 << 40 });
        let workers = vec![small, larger, gone];
        let why = |workers: &[WorkerRow], held: &[Held]| {
            reasons(&tasks, &[], workers, held, &HashMap::new(), now)[&1].clone()
        };
        assert_eq!(
            why(&workers, &[]),
            "needs 12.0 GiB scratch; the most any live worker has free is 3.1 GiB (worker cpu-2)"
        );
        // Once a disk has room, the task waits for a claim like any other.
        let mut roomy = workers.clone();
        roomy[0].disk = Some(WorkerDisk { free: 20 << 30, total: 100 << 30, scratch_free: 13 << 30 });
        assert_eq!(why(&roomy, &[]), "waiting for a worker to claim it (one has room)");
        // A worker that reports no disk: its configured scratch less its leases'.
        let mut unmeasured = worker(5, 0, 8 << 30, now);
        unmeasured.resources.scratch = 16 << 30;
        let held = vec![Held { worker: 5, resources: Resources { cpus: 1, memory: 0, gpus: 0, scratch: 10 << 30 } }];
        assert_eq!(
            why(&[unmeasured.clone()], &held),
            "needs 12.0 GiB scratch; the most any live worker has free is 6.0 GiB (worker w5)"
        );
        assert_eq!(why(&[unmeasured], &[]), "waiting for a worker to claim it (one has room)");
    }

    #[test]
    fn steps_with_fan_out() {
        let spec = json!({"steps": [
            {"id": "download", "kind": "hf.download", "config": {"kind": "hf.download", "path": "/m"}, "needs": []},
            {"id": "shard", "kind": "megatron.shard", "config": {"kind": "megatron.shard"}, "needs": ["download"]}]});
        let tasks = vec![
            task(1, "download", "download", TaskState::Succeeded),
            task(2, "shard", "shard", TaskState::Succeeded),
            task(3, "shard/rank-0", "shard", TaskState::Leased),
            task(4, "shard/rank-1", "shard", TaskState::Ready),
            task(5, "shard/commit", "shard", TaskState::Succeeded),
        ];
        let mut tasks = tasks;
        tasks[1].output = Some(json!({"bytes_per_rank": [100, 300]}));
        tasks[2].payload = rank_payload(0);
        tasks[2].progress = Some(json!({"bytes": 40}));
        tasks[3].payload = rank_payload(1);
        tasks[4].output = Some(json!({"bytes": 999}));
        tasks[0].output = Some(json!({"bytes": 5000}));
        let s = steps(&spec, &tasks, &[]);
        assert_eq!((s[1].bytes, s[1].total_bytes), (40, Some(400)), "the commit's file bytes do not count");
        assert_eq!((s[0].bytes, s[0].total_bytes), (5000, None));
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].id.as_str(), s[0].kind.as_str(), s[0].state.as_str()),
            ("download", "hf.download", "succeeded")
        );
        assert_eq!((s[1].tasks.total, s[1].tasks.succeeded, s[1].state.as_str()), (4, 2, "running"));
        assert_eq!(s[1].needs, ["download"]);
    }
}
