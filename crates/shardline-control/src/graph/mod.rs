//! From a resolved pipeline to the task graph of a run.
//!
//! Every step becomes one task, except `megatron.shard` (and a `megatron.split_fused` that writes
//! its own checkpoint), which fans out: a plan task, one task per rank file of the target job,
//! and a commit task that writes `.metadata` last. The rank count is known from the mesh, so the
//! whole graph exists from submission on; no task ever creates or rewires another.
//!
//! A `checkpoint.reshard` of an object-store prefix fans out into a fetch task (the prefix
//! downloaded as `hf.download` downloads one) and the reshard task; any other reshard, and every
//! `checkpoint.export`, is one task.
//!
//! A `command` step is one task: its argv, environment and directories, and for each step it
//! needs the task whose recorded output becomes its `SHARDLINE_STEP_<ID>_*` variables.
//!
//! A `megatron.split_fused` that follows a shard whose intermediate output is not kept exchanges
//! a plan instead of bytes: the shard writes the split layout directly, and the split task only
//! records that (the source is read once, the output written once).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use shardline_spec::{
    CheckpointSource, DownloadSource, OutputFormatName, ResolvedPipeline, ResolvedStep, StepConfig, StepKind,
};
use shardline_store::{NewTask, Resources};

/// Task kinds, as stored.
pub mod kinds {
    pub const DOWNLOAD: &str = "hf.download";
    pub const PLAN: &str = "megatron.shard.plan";
    pub const RANK: &str = "megatron.shard.rank";
    pub const COMMIT: &str = "megatron.shard.commit";
    pub const SPLIT_PASS: &str = "megatron.split_fused";
    pub const VALIDATE: &str = "checkpoint.validate";
    /// One part of a validation split by rank file (object-store artifact stores).
    pub const VALIDATE_PART: &str = "checkpoint.validate.part";
    pub const RESHARD: &str = "checkpoint.reshard";
    /// One target rank file of a reshard split by rank; the `checkpoint.reshard` task commits.
    pub const RESHARD_RANK: &str = "checkpoint.reshard.rank";
    /// A reshard's object-store source, downloaded.
    pub const RESHARD_FETCH: &str = "checkpoint.reshard.fetch";
    pub const EXPORT: &str = "checkpoint.export";
    /// Some of an export's weight files (see [`ExportJob::parts`]); the export task commits.
    pub const EXPORT_PART: &str = "checkpoint.export.part";
    pub const UPLOAD: &str = "store.upload";
    pub const COMMAND: &str = "command";
}

fn fsdp_dtensor() -> String {
    "fsdp_dtensor".to_string()
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
    /// The checkpoint dialect, `fsdp_dtensor` or `torch_dist` (a Megatron save directory).
    #[serde(default = "fsdp_dtensor")]
    pub target: String,
    /// With `target: torchtitan`: the version whose names are written (empty: `main`).
    #[serde(default)]
    pub torchtitan_version: String,
    /// Task whose output names the source release (`{"path": …}`).
    pub source_task: String,
    /// Where the checkpoint is committed; rank files are staged in `<out>.partial`.
    pub out: PathBuf,
    /// With an object-store artifact store: the checkpoint's prefix there (`s3://…/runs/<run>/
    /// <step>/checkpoint`), `out` unused. Rank tasks upload their files to it in parts and leave
    /// the uploads open; the commit completes them and writes `.metadata` last.
    #[serde(default)]
    pub remote: Option<String>,
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

/// Where a `checkpoint.reshard` reads its checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "from", rename_all = "snake_case")]
pub enum ReshardSource {
    /// The directory an earlier task of the run reports (its output's `dir`, else its `path`):
    /// the upstream checkpoint, or the step's own fetch of an object-store prefix.
    Task { task: String },
    /// A local checkpoint directory, read in place.
    Local { path: PathBuf },
}

/// What a `checkpoint.reshard` task reads and writes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReshardJob {
    pub source: ReshardSource,
    pub tp: u64,
    pub cp: u64,
    pub dp: u64,
    pub ep: u64,
    pub etp: u64,
    /// `from-rank0` or `drop`.
    pub rng: String,
    /// The tokenizer's vocabulary size; `None`: the checkpoint's `args`, else the `config.json`
    /// of `release_task`'s release.
    #[serde(default)]
    pub vocab_size: Option<u64>,
    /// The source mesh (`tp=2,cp=1,…`); `None`: the checkpoint's `args`, else the mesh the
    /// source task reports.
    #[serde(default)]
    pub from_mesh: Option<String>,
    /// The dialect to write (`fsdp_dtensor` translates a `torch_dist` source); `None` keeps
    /// the source's.
    #[serde(default)]
    pub target: Option<String>,
    /// Megatron's vocab divisor when the checkpoint's `args` do not say (the upstream shard's).
    #[serde(default)]
    pub vocab_divisible_by: Option<u64>,
    /// The download the checkpoint was sharded from, when the pipeline has one upstream.
    #[serde(default)]
    pub release_task: Option<String>,
    /// Where the checkpoint is written; it is staged in `<out>.partial` and renamed.
    pub out: PathBuf,
    /// With an object-store artifact store: the prefix the checkpoint is put under instead
    /// (written in the worker's scratch, then uploaded, `.metadata` last).
    #[serde(default)]
    pub remote: Option<String>,
    pub step_hash: String,
    #[serde(default = "yes")]
    pub cache: bool,
    /// Split by rank: tasks `<step>/rank-<r>` ([`Payload::ReshardRank`]) write the target rank
    /// files into `<out>.partial`, and this task commits them (`.metadata` last).
    #[serde(default)]
    pub split: bool,
}

impl ReshardJob {
    pub fn mesh_text(&self) -> String {
        format!("tp={},cp={},dp={},ep={},etp={}", self.tp, self.cp, self.dp, self.ep, self.etp)
    }
}

/// What a `checkpoint.export` task reads and writes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportJob {
    /// The task whose output's `dir` is the checkpoint.
    pub checkpoint_task: String,
    /// The HF release to reproduce; `None`: the output `path` of `release_task`.
    #[serde(default)]
    pub like: Option<PathBuf>,
    #[serde(default)]
    pub release_task: Option<String>,
    /// The expert-TP size the checkpoint was written with; `None`: its `args`, else the mesh its
    /// task reports, else 1.
    #[serde(default)]
    pub etp: Option<u64>,
    pub max_file_size: u64,
    /// Prefix of model keys in the checkpoint.
    pub prefix: String,
    /// The HF directory written (staged beside it and renamed).
    pub out: PathBuf,
    /// With an object-store artifact store: the prefix the directory is put under instead.
    #[serde(default)]
    pub remote: Option<String>,
    pub step_hash: String,
    #[serde(default = "yes")]
    pub cache: bool,
    /// Above 1: tasks `<step>/part-<p>` ([`Payload::ExportPart`]) write weight file `i` when
    /// `i mod parts == p` into the staging directory, and this task commits them (the index,
    /// the release's other files, the rename). 0 or 1: this task writes everything.
    #[serde(default)]
    pub parts: u64,
}

/// What a `command` task runs, and where.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandJob {
    /// The program and its arguments; with `shell`, one script run by `/bin/sh -c`.
    pub run: Vec<String>,
    pub shell: bool,
    /// Variables the spec sets (added to a minimal environment).
    pub env: BTreeMap<String, String>,
    /// The worker's own variables passed through by name.
    pub inherit: Vec<String>,
    /// The working directory (the submitting directory unless the step names one).
    pub workdir: PathBuf,
    /// `SHARDLINE_OUTPUT_DIR`: made empty before each attempt; the step's recorded `dir`.
    pub out: PathBuf,
    /// With an object-store artifact store: the prefix the output directory is put under when
    /// the command succeeds (`out` is then in the worker's scratch).
    #[serde(default)]
    pub remote: Option<String>,
    /// The steps it needs, each with the task whose output describes it.
    pub inputs: Vec<CommandInput>,
}

/// A step a command needs: its outputs become `SHARDLINE_STEP_<ID>_DIR`, `_PATH`, `_URL` and
/// `_RESULT` ([`step_env_prefix`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandInput {
    pub step: String,
    pub task: String,
}

/// `SHARDLINE_STEP_<ID>_`: the step id upper-cased, `-` as `_` (`load-check` →
/// `SHARDLINE_STEP_LOAD_CHECK_`).
pub fn step_env_prefix(step: &str) -> String {
    let id: String = step.chars().map(|c| if c == '-' { '_' } else { c.to_ascii_uppercase() }).collect();
    format!("SHARDLINE_STEP_{id}_")
}

/// The payload of every task: its role and what it needs to know.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Payload {
    Download {
        path: PathBuf,
        step_hash: String,
        /// An object-store artifact store's root: the release is copied there for workers on
        /// other hosts (see [`Payload::HubDownload`]).
        #[serde(default)]
        artifacts: Option<String>,
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
        /// An object-store artifact store's root: the snapshot is also copied to
        /// `<root>/releases/hub/<repo>/<commit>` (once per commit and patterns, whichever run
        /// does it first) and later tasks read it from there.
        #[serde(default)]
        artifacts: Option<String>,
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
        /// With an object-store artifact store: nothing is downloaded; later tasks read the
        /// prefix in place, each object pinned to the ETag this task listed.
        #[serde(default)]
        artifacts: Option<String>,
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
    /// A `checkpoint.reshard`'s object-store source downloaded into a local cache directory, as
    /// [`Payload::ObjectDownload`] downloads a release; its output's `path` is that directory.
    CheckpointFetch {
        url: String,
        cache_dir: PathBuf,
        step_hash: String,
        #[serde(default = "yes")]
        cache: bool,
        /// With an object-store artifact store: the prefix is only listed; the reshard reads it.
        #[serde(default)]
        artifacts: Option<String>,
    },
    Reshard {
        job: ReshardJob,
    },
    /// Target rank file `rank` of a reshard split by rank (see [`ReshardJob::split`]).
    ReshardRank {
        job: ReshardJob,
        rank: u64,
    },
    Export {
        job: ExportJob,
    },
    /// Part `part` of an export split in parts (see [`ExportJob::parts`]).
    ExportPart {
        job: ExportJob,
        part: u64,
    },
    /// The split was applied in the upstream shard plan; this task passes its output on.
    SplitPassThrough {
        checkpoint_task: String,
    },
    Validate {
        checkpoint_task: String,
        source_task: String,
        prefix: String,
        /// The tasks of its parts, when split ([`Payload::ValidatePart`]): this task then checks
        /// `.metadata` alone and that the parts' items add up to it.
        #[serde(default)]
        parts: Vec<String>,
    },
    /// Part `part` of `parts` of a validation: the items of the checkpoint's files
    /// [`part_files`] gives it, checked against the release byte ranges they are made from.
    ValidatePart {
        checkpoint_task: String,
        source_task: String,
        prefix: String,
        part: u64,
        parts: u64,
    },
    Upload {
        /// The checkpoint or export uploaded.
        checkpoint_task: String,
        /// The download whose source the manifest records; `None` (a reshard of a `path`): the
        /// checkpoint task's own `source`.
        #[serde(default)]
        source_task: Option<String>,
        to: String,
        step_hash: String,
    },
    Command {
        job: CommandJob,
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

/// The nearest upstream step (or the step itself) whose output is a checkpoint (or, with
/// `exports`, an exported HF directory), as a terminal task.
fn checkpoint_task_of(p: &ResolvedPipeline, id: &str, exports: bool) -> Option<String> {
    let own = p.step(id).into_iter();
    let mut candidates: Vec<&ResolvedStep> = own.chain(p.upstream(id).into_iter().rev()).collect();
    candidates.retain(|s| s.kind.writes_checkpoint() || (exports && s.kind == StepKind::CheckpointExport));
    candidates.first().map(|s| terminal_task(p, &s.id))
}

/// The nearest upstream checkpoint of a step, not the step itself.
fn upstream_checkpoint_of(p: &ResolvedPipeline, id: &str) -> Option<String> {
    p.upstream(id).into_iter().rev().find(|s| s.kind.writes_checkpoint()).map(|s| terminal_task(p, &s.id))
}

/// The nearest upstream shard step's config value `pick` reads.
fn upstream_shard<T>(p: &ResolvedPipeline, id: &str, pick: impl Fn(&StepConfig) -> Option<T>) -> Option<T> {
    p.upstream(id).iter().rev().find_map(|s| pick(&s.config))
}

/// The model-key prefix of the checkpoint a step reads: its shard step's, unless a reshard in
/// between translated it to `fsdp_dtensor` (whose keys are `model.module.…`).
fn shard_prefix(p: &ResolvedPipeline, id: &str) -> String {
    upstream_shard(p, id, |c| match c {
        StepConfig::MegatronShard { prefix, .. } => Some(prefix.clone()),
        StepConfig::CheckpointReshard { target: Some(t), .. } if t == "fsdp_dtensor" => Some("model.module.".into()),
        StepConfig::CheckpointReshard { target: Some(t), .. } if t == "torch_dist" => Some(String::new()),
        _ => None,
    })
    .unwrap_or_else(|| "model.module.".into())
}

fn local(path: &Path, base_dir: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        base_dir.join(path)
    }
}

/// The `hf.download` task a step reads its source from.
fn source_task_of(p: &ResolvedPipeline, id: &str) -> Option<String> {
    let own = p.step(id).into_iter();
    own.chain(p.upstream(id).into_iter().rev())
        .find(|s| matches!(s.config, StepConfig::HfDownload { .. }))
        .map(|s| s.id.clone())
}

/// Builds the task graph of a run whose work directory is `run_dir`; `base_dir` resolves relative
/// paths of the spec (the directory the pipeline was submitted from). With `artifacts` (an
/// object-store URL), step outputs live under `<artifacts>/runs/<run name>/<step>` instead, for
/// workers that share no disk.
pub fn tasks_for(
    p: &ResolvedPipeline,
    run_dir: &Path,
    base_dir: &Path,
    artifacts: Option<&str>,
) -> Result<Vec<NewTask>, String> {
    let hashes = p.step_hashes();
    let artifacts = artifacts.map(|a| a.trim_end_matches('/'));
    let run_name = run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let remote_at = |step: &str, leaf: &str| artifacts.map(|a| format!("{a}/runs/{run_name}/{step}/{leaf}"));
    let remote_out = |step: &str| remote_at(step, "checkpoint");
    let mut tasks = Vec::new();
    for step in p.topo_order() {
        let needs: Vec<String> = step.needs.iter().map(|n| terminal_task(p, n)).collect();
        let step_hash = hashes.get(&step.id).cloned().unwrap_or_default();
        let missing = |what: &str| format!("step `{}` has no upstream {what}", step.id);
        match &step.config {
            StepConfig::HfDownload { source: DownloadSource::Local { path } } => {
                let path = local(path, base_dir);
                let payload = Payload::Download { path, step_hash, artifacts: artifacts.map(str::to_string) };
                tasks.push(base(step, step.id.clone(), kinds::DOWNLOAD, needs, payload));
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
                    artifacts: artifacts.map(str::to_string),
                };
                tasks.push(base(step, step.id.clone(), kinds::DOWNLOAD, needs, payload));
            }
            StepConfig::HfDownload { source: DownloadSource::ObjectStore { url } } => {
                let payload = Payload::ObjectDownload {
                    url: url.clone(),
                    cache_dir: object_cache_dir(run_dir),
                    step_hash,
                    cache: step.cache,
                    artifacts: artifacts.map(str::to_string),
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
                target,
                torchtitan_version,
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
                    target: target.clone(),
                    torchtitan_version: torchtitan_version.clone(),
                    source_task: source_task_of(p, &step.id).ok_or_else(|| missing("hf.download"))?,
                    out: run_dir.join(&step.id).join("checkpoint"),
                    remote: remote_out(&step.id),
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
                    job.remote = remote_out(&step.id);
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
            StepConfig::CheckpointReshard { source, tp, cp, dp, ep, etp, rng, vocab_size, from_mesh, target } => {
                let mut needs = needs;
                let (source, release_task, vocab_divisible_by) = match source {
                    Some(CheckpointSource::Local { path }) => {
                        (ReshardSource::Local { path: local(path, base_dir) }, None, None)
                    }
                    Some(CheckpointSource::ObjectStore { url }) => {
                        let fetch = format!("{}/fetch", step.id);
                        let payload = Payload::CheckpointFetch {
                            url: url.clone(),
                            cache_dir: object_cache_dir(run_dir),
                            step_hash: step_hash.clone(),
                            cache: step.cache,
                            artifacts: artifacts.map(str::to_string),
                        };
                        tasks.push(base(step, fetch.clone(), kinds::RESHARD_FETCH, needs, payload));
                        needs = vec![fetch.clone()];
                        (ReshardSource::Task { task: fetch }, None, None)
                    }
                    None => {
                        let task = upstream_checkpoint_of(p, &step.id).ok_or_else(|| missing("checkpoint"))?;
                        let divisor = upstream_shard(p, &step.id, |c| match c {
                            StepConfig::MegatronShard { vocab_divisible_by, .. } => Some(*vocab_divisible_by),
                            _ => None,
                        });
                        (ReshardSource::Task { task }, source_task_of(p, &step.id), divisor)
                    }
                };
                let job = ReshardJob {
                    source,
                    tp: *tp,
                    cp: *cp,
                    dp: *dp,
                    ep: *ep,
                    etp: *etp,
                    rng: rng.as_str().to_string(),
                    vocab_size: *vocab_size,
                    from_mesh: from_mesh.clone(),
                    target: target.clone(),
                    vocab_divisible_by,
                    release_task,
                    out: run_dir.join(&step.id).join("checkpoint"),
                    remote: remote_out(&step.id),
                    step_hash,
                    cache: step.cache,
                    split: false,
                };
                tasks.extend(reshard_tasks(step, needs, job));
            }
            StepConfig::CheckpointExport { like, etp, max_file_size, parts } => {
                let checkpoint_task = upstream_checkpoint_of(p, &step.id).ok_or_else(|| missing("checkpoint"))?;
                // With neither a `like` nor a download, the checkpoint must describe its own
                // release (a NeMo Automodel save, which the lint has found): the export says so.
                let release_task = source_task_of(p, &step.id);
                let job = ExportJob {
                    checkpoint_task,
                    like: like.as_deref().map(|l| local(l, base_dir)),
                    release_task,
                    etp: *etp,
                    max_file_size: *max_file_size,
                    prefix: shard_prefix(p, &step.id),
                    out: run_dir.join(&step.id).join("hf"),
                    remote: remote_at(&step.id, "hf"),
                    step_hash,
                    cache: step.cache,
                    parts: *parts,
                };
                tasks.extend(export_tasks(step, needs, job));
            }
            StepConfig::CheckpointValidate {} => {
                let checkpoint_task = checkpoint_task_of(p, &step.id, false).ok_or_else(|| missing("checkpoint"))?;
                let source_task = source_task_of(p, &step.id).ok_or_else(|| missing("hf.download"))?;
                let prefix = shard_prefix(p, &step.id);
                // Workers that share no disk split it by rank file, so none reads the whole.
                let parts = if artifacts.is_some() { validate_parts(p, &step.id) } else { 1 };
                let mut part_tasks = Vec::new();
                for part in (0..parts).filter(|_| parts > 1) {
                    let name = validate_part_task(&step.id, part);
                    part_tasks.push(name.clone());
                    let payload = Payload::ValidatePart {
                        checkpoint_task: checkpoint_task.clone(),
                        source_task: source_task.clone(),
                        prefix: prefix.clone(),
                        part,
                        parts,
                    };
                    tasks.push(base(step, name, kinds::VALIDATE_PART, needs.clone(), payload));
                }
                let needs = if part_tasks.is_empty() { needs } else { part_tasks.clone() };
                let payload = Payload::Validate { checkpoint_task, source_task, prefix, parts: part_tasks };
                tasks.push(base(step, step.id.clone(), kinds::VALIDATE, needs, payload));
            }
            StepConfig::StoreUpload { to } => {
                let checkpoint_task = checkpoint_task_of(p, &step.id, true).ok_or_else(|| missing("checkpoint"))?;
                let source_task = source_task_of(p, &step.id);
                let to = resolve_destination(to, base_dir);
                tasks.push(base(
                    step,
                    step.id.clone(),
                    kinds::UPLOAD,
                    needs,
                    Payload::Upload { checkpoint_task, source_task, to, step_hash },
                ));
            }
            StepConfig::Command { run, shell, env, inherit, workdir } => {
                let job = CommandJob {
                    run: run.clone(),
                    shell: *shell,
                    env: env.clone(),
                    inherit: inherit.clone(),
                    workdir: workdir.as_deref().map_or_else(|| base_dir.to_path_buf(), |w| local(w, base_dir)),
                    out: run_dir.join(&step.id).join("out"),
                    remote: remote_at(&step.id, "out"),
                    inputs: step
                        .needs
                        .iter()
                        .zip(&needs)
                        .map(|(n, task)| CommandInput { step: n.clone(), task: task.clone() })
                        .collect(),
                };
                tasks.push(base(step, step.id.clone(), kinds::COMMAND, needs, Payload::Command { job }));
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

/// The name of part `part` of the validation step `step`.
pub fn validate_part_task(step: &str, part: u64) -> String {
    format!("{step}/part-{part}")
}

/// The files of a checkpoint (object names under its prefix) part `part` of `parts` of its
/// validation reads: every `parts`-th of its storage files in name order.
pub fn part_files(names: &[String], part: u64, parts: u64) -> Vec<String> {
    let mut files: Vec<&String> = names.iter().filter(|n| !n.starts_with('.')).collect();
    files.sort();
    files.into_iter().zip(0u64..).filter(|(_, i)| i % parts.max(1) == part).map(|(n, _)| n.clone()).collect()
}

/// Into how many parts the validation `id` is split: one per rank file of the checkpoint it
/// reads, when the spec gives its mesh.
fn validate_parts(p: &ResolvedPipeline, id: &str) -> u64 {
    let own = p.step(id).into_iter();
    let mut candidates = own.chain(p.upstream(id).into_iter().rev()).filter(|s| s.kind.writes_checkpoint());
    let Some(step) = candidates.next() else { return 1 };
    let shard = match step.config {
        StepConfig::MegatronSplitFused { .. } => shard_parent(p, &step.id),
        _ => Some(step),
    };
    shard.and_then(|s| s.config.mesh()).map_or(1, |m| m.world())
}

/// The name of the task that writes rank file `rank` of the shard whose plan task is `plan_task`.
pub fn rank_task(plan_task: &str, rank: u64) -> String {
    format!("{plan_task}/rank-{rank}")
}

mod fan_out;
use fan_out::{export_tasks, fan_out, reshard_tasks};

#[cfg(test)]
mod tests;
