//! From a resolved pipeline to the task graph of a run.
//!
//! Every step becomes one task, except `megatron.shard` (and a `megatron.split_fused` that writes
//! its own checkpoint), which fans out: a plan task, one task per rank file of the target job,
//! and a commit task that writes `.metadata` last. The rank count is known from the mesh, so the
//! whole graph exists from submission on; no task ever creates or rewires another.
//!
//! A `megatron.split_fused` that follows a shard whose intermediate output is not kept exchanges
//! a plan instead of bytes: the shard writes the split layout directly, and the split task only
//! records that (the source is read once, the output written once).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use shardline_spec::{DownloadSource, OutputFormatName, ResolvedPipeline, ResolvedStep, StepConfig};
use shardline_store::{NewTask, Resources};

/// Task kinds, as stored.
pub mod kinds {
    pub const DOWNLOAD: &str = "hf.download";
    pub const PLAN: &str = "megatron.shard.plan";
    pub const RANK: &str = "megatron.shard.rank";
    pub const COMMIT: &str = "megatron.shard.commit";
    pub const SPLIT_PASS: &str = "megatron.split_fused";
    pub const VALIDATE: &str = "checkpoint.validate";
    pub const UPLOAD: &str = "store.upload";
}

/// What a sharding subgraph writes. (`Default` is an empty job, for tests to fill in.)
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardJob {
    pub tp: u64,
    pub cp: u64,
    pub dp: u64,
    pub ep: u64,
    pub etp: u64,
    pub format: String,
    pub prefix: String,
    pub optimizer_state: bool,
    pub vocab_divisible_by: u64,
    /// Split fused projections (the `fsdp_dtensor` form) or keep them fused.
    pub split_fused: bool,
    /// Task whose output names the source release (`{"path": …}`).
    pub source_task: String,
    /// Where the checkpoint is committed; rank files are staged in `<out>.partial`.
    pub out: PathBuf,
    /// The step's cache key material (spec hash of the step and its upstream).
    pub step_hash: String,
    /// The step's `cache`: serve the checkpoint from the step cache when an identical one exists,
    /// and remember this one. `false` always recomputes.
    #[serde(default = "yes")]
    pub cache: bool,
}

fn yes() -> bool {
    true
}

impl ShardJob {
    pub fn world(&self) -> u64 {
        self.tp * self.cp * self.dp
    }
}

/// The payload of every task: its role and what it needs to know.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Payload {
    Download {
        path: PathBuf,
        step_hash: String,
    },
    /// `hf.download` of a Hub repository into the HF cache; its output's `path` is the snapshot.
    HubDownload {
        repo: String,
        revision: String,
        allow: Vec<String>,
        ignore: Vec<String>,
        /// `None`: the worker's `HF_ENDPOINT`, else the public Hub.
        endpoint: Option<String>,
        step_hash: String,
        /// The step's `cache`: serve the snapshot from the step cache when this commit was
        /// downloaded with these patterns before.
        #[serde(default = "yes")]
        cache: bool,
    },
    /// `hf.download` of an object-store prefix into a local cache directory; its output's `path`
    /// is that directory.
    ObjectDownload {
        /// `s3://bucket/prefix`, `gs://…`, `az://…` or `file:///abs/dir`.
        url: String,
        /// Where downloads are cached (`<work>/cache/objects`), unless the worker names its own.
        cache_dir: PathBuf,
        step_hash: String,
        /// The step's `cache`: serve the directory from the step cache when the prefix lists the
        /// same objects (names, sizes, ETags) as before.
        #[serde(default = "yes")]
        cache: bool,
    },
    Plan {
        job: ShardJob,
    },
    Rank {
        job: ShardJob,
        plan_task: String,
        rank: u64,
    },
    Commit {
        job: ShardJob,
        plan_task: String,
    },
    /// The split was applied in the upstream shard plan; this task passes its output on.
    SplitPassThrough {
        checkpoint_task: String,
    },
    Validate {
        checkpoint_task: String,
        source_task: String,
        prefix: String,
    },
    Upload {
        checkpoint_task: String,
        source_task: String,
        to: String,
        step_hash: String,
    },
}

fn resources(step: &ResolvedStep) -> Resources {
    Resources {
        cpus: step.resources.cpus,
        memory: step.resources.memory_bytes,
        gpus: step.resources.gpus,
        scratch: step.resources.scratch_bytes,
    }
}

fn base(step: &ResolvedStep, name: String, kind: &str, needs: Vec<String>, payload: Payload) -> NewTask {
    NewTask {
        name,
        step_id: step.id.clone(),
        kind: kind.to_string(),
        needs,
        resources: resources(step),
        payload: serde_json::to_value(&payload).unwrap_or(serde_json::Value::Null),
        max_attempts: step.retry.attempts.max(1),
        max_lost: step.retry.lost.max(1),
        backoff: step.retry.backoff,
        timeout: step.timeout,
        cache_key: None,
    }
}

/// The name of the task whose success means "step `id` is done" (its output is the step's output).
pub fn terminal_task(p: &ResolvedPipeline, id: &str) -> String {
    match p.step(id).map(|s| &s.config) {
        Some(StepConfig::MegatronShard { .. }) => format!("{id}/commit"),
        Some(StepConfig::MegatronSplitFused { .. }) if split_writes_own_checkpoint(p, id) => format!("{id}/commit"),
        _ => id.to_string(),
    }
}

/// The shard step a split step follows.
fn shard_parent<'a>(p: &'a ResolvedPipeline, split_id: &str) -> Option<&'a ResolvedStep> {
    let s = p.step(split_id)?;
    s.needs.iter().filter_map(|n| p.step(n)).find(|n| matches!(n.config, StepConfig::MegatronShard { .. }))
}

/// A split writes its own checkpoint only when its shard keeps the fused intermediate output.
fn split_writes_own_checkpoint(p: &ResolvedPipeline, split_id: &str) -> bool {
    matches!(shard_parent(p, split_id).map(|s| &s.config), Some(StepConfig::MegatronShard { keep: true, .. }))
}

/// Whether a shard step's plan applies the split (a split follows and the fused form is not kept).
fn shard_applies_split(p: &ResolvedPipeline, shard_id: &str) -> bool {
    let keep = matches!(p.step(shard_id).map(|s| &s.config), Some(StepConfig::MegatronShard { keep: true, .. }));
    let has_split = p
        .steps
        .iter()
        .any(|s| matches!(s.config, StepConfig::MegatronSplitFused { .. }) && s.needs.iter().any(|n| n == shard_id));
    has_split && !keep
}

/// The nearest upstream step (or the step itself) whose output is a checkpoint, as a terminal task.
fn checkpoint_task_of(p: &ResolvedPipeline, id: &str) -> Option<String> {
    let own = p.step(id).into_iter();
    let mut candidates: Vec<&ResolvedStep> = own.chain(p.upstream(id).into_iter().rev()).collect();
    candidates.retain(|s| matches!(s.config, StepConfig::MegatronShard { .. } | StepConfig::MegatronSplitFused { .. }));
    candidates.first().map(|s| terminal_task(p, &s.id))
}

/// The `hf.download` task a step reads its source from.
fn source_task_of(p: &ResolvedPipeline, id: &str) -> Option<String> {
    let own = p.step(id).into_iter();
    own.chain(p.upstream(id).into_iter().rev())
        .find(|s| matches!(s.config, StepConfig::HfDownload { .. }))
        .map(|s| s.id.clone())
}

/// Builds the task graph of a run whose work directory is `run_dir`; `base_dir` resolves relative
/// paths of the spec (the directory the pipeline was submitted from).
pub fn tasks_for(p: &ResolvedPipeline, run_dir: &Path, base_dir: &Path) -> Result<Vec<NewTask>, String> {
    let hashes = p.step_hashes();
    let mut tasks = Vec::new();
    for step in p.topo_order() {
        let needs: Vec<String> = step.needs.iter().map(|n| terminal_task(p, n)).collect();
        let step_hash = hashes.get(&step.id).cloned().unwrap_or_default();
        let missing = |what: &str| format!("step `{}` has no upstream {what}", step.id);
        match &step.config {
            StepConfig::HfDownload { source: DownloadSource::Local { path } } => {
                let path = if path.is_absolute() { path.clone() } else { base_dir.join(path) };
                tasks.push(base(step, step.id.clone(), kinds::DOWNLOAD, needs, Payload::Download { path, step_hash }));
            }
            StepConfig::HfDownload { source: DownloadSource::Hub { repo, revision, allow, ignore, endpoint } } => {
                let payload = Payload::HubDownload {
                    repo: repo.clone(),
                    revision: revision.clone(),
                    allow: allow.clone(),
                    ignore: ignore.clone(),
                    endpoint: endpoint.clone(),
                    step_hash,
                    cache: step.cache,
                };
                tasks.push(base(step, step.id.clone(), kinds::DOWNLOAD, needs, payload));
            }
            StepConfig::HfDownload { source: DownloadSource::ObjectStore { url } } => {
                let payload = Payload::ObjectDownload {
                    url: url.clone(),
                    cache_dir: object_cache_dir(run_dir),
                    step_hash,
                    cache: step.cache,
                };
                tasks.push(base(step, step.id.clone(), kinds::DOWNLOAD, needs, payload));
            }
            StepConfig::MegatronShard {
                tp,
                cp,
                dp,
                ep,
                etp,
                format,
                prefix,
                optimizer_state,
                vocab_divisible_by,
                ..
            } => {
                let job = ShardJob {
                    tp: *tp,
                    cp: *cp,
                    dp: *dp,
                    ep: *ep,
                    etp: *etp,
                    format: match format {
                        OutputFormatName::Dcp => "dcp".into(),
                        OutputFormatName::DcpSafetensors => "dcp-safetensors".into(),
                    },
                    prefix: prefix.clone(),
                    optimizer_state: *optimizer_state,
                    vocab_divisible_by: *vocab_divisible_by,
                    split_fused: shard_applies_split(p, &step.id),
                    source_task: source_task_of(p, &step.id).ok_or_else(|| missing("hf.download"))?,
                    out: run_dir.join(&step.id).join("checkpoint"),
                    step_hash,
                    cache: step.cache,
                };
                fan_out(&mut tasks, step, &step.id, needs, job);
            }
            StepConfig::MegatronSplitFused { .. } => {
                let parent = shard_parent(p, &step.id).ok_or_else(|| missing("megatron.shard"))?;
                if split_writes_own_checkpoint(p, &step.id) {
                    let mut job = tasks
                        .iter()
                        .find(|t| t.name == parent.id)
                        .and_then(|t| serde_json::from_value::<Payload>(t.payload.clone()).ok())
                        .and_then(|pl| match pl {
                            Payload::Plan { job } => Some(job),
                            _ => None,
                        })
                        .ok_or_else(|| missing("megatron.shard plan"))?;
                    job.split_fused = true;
                    job.out = run_dir.join(&step.id).join("checkpoint");
                    job.step_hash = step_hash;
                    job.cache = step.cache;
                    fan_out(&mut tasks, step, &step.id, needs, job);
                } else {
                    let checkpoint_task = terminal_task(p, &parent.id);
                    tasks.push(base(
                        step,
                        step.id.clone(),
                        kinds::SPLIT_PASS,
                        needs,
                        Payload::SplitPassThrough { checkpoint_task },
                    ));
                }
            }
            StepConfig::CheckpointValidate {} => {
                let checkpoint_task = checkpoint_task_of(p, &step.id).ok_or_else(|| missing("checkpoint"))?;
                let source_task = source_task_of(p, &step.id).ok_or_else(|| missing("hf.download"))?;
                let prefix = p
                    .upstream(&step.id)
                    .iter()
                    .rev()
                    .find_map(|s| match &s.config {
                        StepConfig::MegatronShard { prefix, .. } => Some(prefix.clone()),
                        _ => None,
                    })
                    .unwrap_or_else(|| "model.module.".into());
                tasks.push(base(
                    step,
                    step.id.clone(),
                    kinds::VALIDATE,
                    needs,
                    Payload::Validate { checkpoint_task, source_task, prefix },
                ));
            }
            StepConfig::StoreUpload { to } => {
                let checkpoint_task = checkpoint_task_of(p, &step.id).ok_or_else(|| missing("checkpoint"))?;
                let source_task = source_task_of(p, &step.id).ok_or_else(|| missing("hf.download"))?;
                let to = resolve_destination(to, base_dir);
                tasks.push(base(
                    step,
                    step.id.clone(),
                    kinds::UPLOAD,
                    needs,
                    Payload::Upload { checkpoint_task, source_task, to, step_hash },
                ));
            }
        }
    }
    Ok(tasks)
}

/// The download cache of object-store sources: `<work>/cache/objects`, next to `<work>/runs`
/// (a run's directory is `<work>/runs/<run name>`).
fn object_cache_dir(run_dir: &Path) -> PathBuf {
    let work = run_dir.parent().and_then(Path::parent).unwrap_or(run_dir);
    work.join("cache").join("objects")
}

/// `file://relative/dir` and relative paths are taken relative to the submitting directory.
fn resolve_destination(to: &str, base_dir: &Path) -> String {
    let path = to.strip_prefix("file://").unwrap_or(to);
    if to.contains("://") && !to.starts_with("file://") {
        return to.to_string();
    }
    let p = Path::new(path);
    if p.is_absolute() {
        format!("file://{}", p.display())
    } else {
        format!("file://{}", base_dir.join(p).display())
    }
}

fn fan_out(tasks: &mut Vec<NewTask>, step: &ResolvedStep, name: &str, needs: Vec<String>, job: ShardJob) {
    let plan = name.to_string();
    tasks.push(base(step, plan.clone(), kinds::PLAN, needs, Payload::Plan { job: job.clone() }));
    let mut ranks = Vec::new();
    for rank in 0..job.world() {
        let n = format!("{name}/rank-{rank}");
        ranks.push(n.clone());
        tasks.push(base(
            step,
            n,
            kinds::RANK,
            vec![plan.clone()],
            Payload::Rank { job: job.clone(), plan_task: plan.clone(), rank },
        ));
    }
    tasks.push(base(step, format!("{name}/commit"), kinds::COMMIT, ranks, Payload::Commit { job, plan_task: plan }));
}
