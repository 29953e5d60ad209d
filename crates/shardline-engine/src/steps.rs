//! What each task does. These functions block (they move bytes); the worker runs them on a
//! blocking thread and watches their [`Progress`] for heartbeats and cancellation.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use serde_json::json;
use sha2::{Digest, Sha256};
use shardline_formats::checkpoint::{open_checkpoint, resolve_checkpoint_dir, TORCHTITAN_SEED_DIR};
use shardline_formats::execute::{self, ExecuteOptions, OutputFormat, Progress};
use shardline_formats::safetensors::Release;
use shardline_formats::training::save_dir::{self, SeedArgs};
use shardline_layout::{
    build_plan, validate_plan, Dialect, Mesh, ModelConfig, Plan, PlanOptions, SourceTensor, TorchtitanTarget,
    TorchtitanVersion,
};
use thiserror::Error;

use crate::checkpoints;
use crate::hub::{self, HubRequest, HubSettings};
use crate::objects::{self, ObjectSourceSettings};
use shardline_control::graph::{Payload, ShardJob};
use shardline_control::TaskOutput;

/// Why a task failed; `retryable` decides whether another attempt may help.
#[derive(Debug, Error)]
#[error("{message}")]
pub struct StepError {
    pub message: String,
    pub retryable: bool,
}

impl StepError {
    /// A failure another attempt cannot fix (bad input, invariant broken, mismatch).
    pub fn fatal(message: impl Into<String>) -> StepError {
        StepError { message: message.into(), retryable: false }
    }
    /// A failure worth retrying (I/O, a lost file).
    pub fn transient(message: impl Into<String>) -> StepError {
        StepError { message: message.into(), retryable: true }
    }
}

/// What a running task can see and report.
pub struct StepContext<'a> {
    /// Outputs of the run's succeeded tasks, by task name.
    pub outputs: &'a BTreeMap<String, TaskOutput>,
    /// Bytes, chunks and files done (sent with each heartbeat); `cancel` asks the task to stop.
    pub progress: &'a Arc<Progress>,
    /// Bytes the task will move in all, when it knows (a download does), else 0.
    pub bytes_total: &'a Arc<AtomicU64>,
    pub log: &'a (dyn Fn(String) + Sync),
    /// How Hub downloads reach the Hub.
    pub hub: &'a HubSettings,
    /// How object-store sources are reached and where they are cached.
    pub objects: &'a ObjectSourceSettings,
    /// The CPUs the task leased: how many threads it may keep busy.
    pub cpus: u32,
    /// The GPU devices the worker gave the task's lease (`CUDA_VISIBLE_DEVICES` of a command).
    pub gpus: &'a [u32],
    /// The step's timeout (zero: none); a command stops itself when it passes.
    pub timeout: std::time::Duration,
    /// Where a command's stderr lines go (`log` takes its stdout and every other line).
    pub stderr: &'a (dyn Fn(String) + Sync),
    /// The worker's runtime: what reads and writes the artifact store and the job store.
    pub runtime: &'a tokio::runtime::Handle,
    /// Records the multipart uploads the task opens (`None`: outside a worker's lease).
    pub ledger: Option<&'a crate::remote::UploadLedger>,
    /// The task's own staging directory (removed when it ends).
    pub scratch: &'a Path,
    /// The worker's scratch root (its object cache lives under it).
    pub scratch_root: &'a Path,
}

impl StepContext<'_> {
    pub(crate) fn output(&self, task: &str) -> Result<&TaskOutput, StepError> {
        self.outputs.get(task).ok_or_else(|| StepError::transient(format!("output of task `{task}` is not available")))
    }

    /// The release a download task recorded, as a local directory: its `path` when this host
    /// has it, else its artifact prefix read into the worker's object cache.
    pub(crate) fn source_path(&self, task: &str) -> Result<PathBuf, StepError> {
        let output = self.output(task)?;
        match (&output.path, &output.artifact) {
            (Some(p), _) if p.exists() => Ok(p.clone()),
            (_, Some(_)) => crate::remote::materialize(output, self)?
                .ok_or_else(|| StepError::fatal(format!("task `{task}` did not report a source path"))),
            (Some(p), None) => Ok(p.clone()),
            (None, None) => Err(StepError::fatal(format!("task `{task}` did not report a source path"))),
        }
    }
}

/// Content digest of a release: file names, sizes, modification times and every safetensors
/// header. Cheap (no tensor data is read) and changes whenever a file is replaced.
pub fn release_digest(release: &Release) -> Result<String, StepError> {
    let mut h = Sha256::new();
    h.update(release.config_json().as_bytes());
    for f in release.files() {
        let meta = fs::metadata(f.path()).map_err(|e| StepError::transient(format!("{}: {e}", f.path().display())))?;
        h.update(f.path().file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default().as_bytes());
        h.update(meta.len().to_le_bytes());
        h.update(meta.mtime().to_le_bytes());
        h.update(meta.mtime_nsec().to_le_bytes());
        for t in f.tensors() {
            h.update(format!("{}:{}:{:?}:{}:{}", t.name, t.dtype, t.shape, t.file_offset, t.byte_len).as_bytes());
        }
    }
    Ok(hex::encode(h.finalize()))
}

pub(crate) fn open_release(path: &Path) -> Result<Release, StepError> {
    Release::open(path).map_err(|e| StepError::fatal(format!("reading release {}: {e}", path.display())))
}

/// A downloaded directory (a download step's `output.path`) must be a release the later steps
/// can read: checked before the step succeeds.
fn checked_release(output: TaskOutput, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    let release = open_release(output.path.as_deref().unwrap_or(Path::new("")))?;
    (ctx.log)(format!(
        "release ok: {} files, {} tensors, {} bytes",
        release.files().len(),
        release.tensors().len(),
        release.total_bytes()
    ));
    Ok(output)
}

/// Rebuilds a job's plan from its inputs (a pure function of config, inventory, mesh, options).
pub fn job_plan(job: &ShardJob, release: &Release) -> Result<Plan, StepError> {
    let config = ModelConfig::from_json(release.config_json()).map_err(|e| StepError::fatal(e.to_string()))?;
    let sources = release
        .tensors()
        .map(|t| SourceTensor { name: t.info.name.clone(), dtype: t.info.dtype, shape: t.info.shape.clone() })
        .collect();
    let mesh = Mesh { tp: job.tp, cp: job.cp, dp: job.dp, ep: job.ep, etp: job.etp };
    let dialect = job_dialect(job)?;
    let options = PlanOptions {
        prefix: job.prefix.clone(),
        vocab_divisible_by: job.vocab_divisible_by,
        optimizer_state: job.optimizer_state,
        // torch_dist places the sections of fused projections itself (`[gate; up]`).
        split_fused: job.split_fused || dialect == Dialect::TorchDist,
        dialect,
        ..PlanOptions::default()
    };
    let plan = build_plan(&config, sources, mesh, &options).map_err(|errors| {
        StepError::fatal(format!(
            "cannot plan `{}` for {mesh}: {}",
            config.model_type,
            errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
        ))
    })?;
    let violations = validate_plan(&plan, config.num_experts, mesh.ep);
    if !violations.is_empty() {
        return Err(StepError::fatal(format!(
            "the plan breaks {} invariant(s): {}",
            violations.len(),
            violations.iter().take(5).map(ToString::to_string).collect::<Vec<_>>().join("; ")
        )));
    }
    Ok(plan)
}

/// The dialect a job writes (`fsdp_dtensor` when the job names none; torchtitan's seed in fp32,
/// of the version the job names).
pub(crate) fn job_dialect(job: &ShardJob) -> Result<Dialect, StepError> {
    match job.target.as_str() {
        "" => Ok(Dialect::FsdpDtensor),
        "torchtitan" => {
            let version = match job.torchtitan_version.as_str() {
                "" => TorchtitanVersion::Main,
                v => TorchtitanVersion::parse(v)
                    .ok_or_else(|| StepError::fatal(format!("unknown torchtitan version `{v}`")))?,
            };
            Ok(Dialect::Torchtitan(TorchtitanTarget { version, ..TorchtitanTarget::default() }))
        }
        t => Dialect::parse(t)
            .ok_or_else(|| StepError::fatal(format!("unknown target `{t}` (fsdp_dtensor, torch_dist, torchtitan)"))),
    }
}

/// A stable digest of a plan: every key, dtype, shape, recipe and chunk.
pub fn plan_digest(plan: &Plan) -> String {
    let mut h = Sha256::new();
    h.update(format!("{:?}{:?}", plan.mesh, plan.options).as_bytes());
    for t in &plan.tensors {
        h.update(format!("{:?}", t).as_bytes());
    }
    hex::encode(h.finalize())
}

/// The cache key of a sharding job: what determines its output bytes.
pub fn shard_cache_key(job: &ShardJob, source_digest: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"shardline megatron.shard\0");
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    h.update(job.step_hash.as_bytes());
    h.update(
        format!(
            "{}/{}/{}/{}/{}/{}/{}/{}/{}/{}",
            job.tp,
            job.cp,
            job.dp,
            job.ep,
            job.etp,
            job.format,
            job.prefix,
            job.optimizer_state,
            job.vocab_divisible_by,
            job.split_fused
        )
        .as_bytes(),
    );
    // The dialect only when it is not the default, so keys made before it existed still serve.
    if !matches!(job.target.as_str(), "" | "fsdp_dtensor") {
        h.update(format!("\0target {}", job.target).as_bytes());
    }
    h.update(source_digest.as_bytes());
    // A checkpoint in an artifact store serves the runs of that store only (their workers may
    // not see a local one, and a local run should not read a remote one back).
    artifact_root_key(&mut h, job.remote.as_deref());
    hex::encode(h.finalize())
}

/// Adds to a step-cache key the artifact store an output lives in (`remote`, under its
/// `/runs/`), if any.
pub(crate) fn artifact_root_key(h: &mut Sha256, remote: Option<&str>) {
    if let Some(root) = remote.and_then(|r| r.find("/runs/").map(|i| &r[..i])) {
        h.update(b"\0artifacts\0");
        h.update(root.as_bytes());
    }
}

/// Whether a cached checkpoint output still points at a complete checkpoint.
pub fn cached_checkpoint_usable(output: &TaskOutput) -> bool {
    output.dir.as_deref().is_some_and(committed_checkpoint)
}

/// Whether `dir` holds a committed checkpoint: its `.metadata`, or for a Megatron save
/// directory, the checkpoint its tracker names.
pub(crate) fn committed_checkpoint(dir: &Path) -> bool {
    resolve_checkpoint_dir(dir).is_ok_and(|d| open_checkpoint(&d).is_ok())
}

/// Where the job's output is assembled before it is renamed into place.
fn staging_root(job: &ShardJob) -> PathBuf {
    let mut s = job.out.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

/// Where rank files are written: the staging root, or for torch_dist its checkpoint directory
/// (the save directory's `release/`), for torchtitan its `step-0/`.
fn staging_dir(job: &ShardJob) -> PathBuf {
    match job_dialect(job) {
        Ok(Dialect::TorchDist) => save_dir::seed_dir(&staging_root(job)),
        Ok(Dialect::Torchtitan(_)) => staging_root(job).join(TORCHTITAN_SEED_DIR),
        _ => staging_root(job),
    }
}

pub(crate) fn exec_options(job: &ShardJob) -> ExecuteOptions {
    ExecuteOptions {
        format: if job.format == "dcp-safetensors" { OutputFormat::DcpSafetensors } else { OutputFormat::Dcp },
        threads: 1,
        overwrite: true,
        ..ExecuteOptions::default()
    }
}

/// The plan a rank or commit task works from, checked against what the plan task recorded.
fn checked_plan(ctx: &StepContext, job: &ShardJob, plan_task: &str) -> Result<(Release, Plan), StepError> {
    let recorded = ctx.output(plan_task)?.plan_digest.clone().unwrap_or_default();
    let release = open_release(&ctx.source_path(&job.source_task)?)?;
    let plan = job_plan(job, &release)?;
    let digest = plan_digest(&plan);
    if digest != recorded {
        return Err(StepError::fatal(format!(
            "the plan rebuilt from the run's inputs ({digest}) differs from the one recorded by `{plan_task}` ({recorded}): the source changed during the run"
        )));
    }
    Ok((release, plan))
}

/// The cached checkpoint's output when the plan task was served from the step cache.
fn is_cached(ctx: &StepContext, plan_task: &str) -> Result<Option<TaskOutput>, StepError> {
    Ok(ctx.output(plan_task)?.cached.as_ref().map(TaskOutput::from_value))
}

/// Runs one task. Returns its output.
pub fn execute(payload: &Payload, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    match payload {
        Payload::Download { path, artifacts, .. } => {
            let release = open_release(path)?;
            let digest = release_digest(&release)?;
            (ctx.log)(format!(
                "release {} ok: {} files, {} tensors, {} bytes",
                path.display(),
                release.files().len(),
                release.tensors().len(),
                release.total_bytes()
            ));
            let output = TaskOutput {
                path: Some(path.clone()),
                digest: Some(digest),
                bytes: Some(release.total_bytes()),
                files: Some(release.files().len() as u64),
                ..TaskOutput::default()
            };
            match artifacts {
                Some(root) => crate::remote::publish_release(output, root, ctx),
                None => Ok(output),
            }
        }
        Payload::HubDownload { repo, revision, allow, ignore, endpoint, artifacts, .. } => {
            let req = HubRequest { repo, revision, allow, ignore, endpoint: endpoint.as_deref() };
            let output = checked_release(TaskOutput::from_value(&hub::download(&req, ctx.hub, ctx)?), ctx)?;
            match artifacts {
                Some(root) => crate::remote::publish_release(output, root, ctx),
                None => Ok(output),
            }
        }
        Payload::ObjectDownload { url, artifacts: Some(root), .. } => crate::remote::list_source(url, root, ctx),
        Payload::ObjectDownload { url, cache_dir, .. } => {
            let cache_root = ctx.objects.cache_dir.as_deref().unwrap_or(cache_dir);
            checked_release(TaskOutput::from_value(&objects::download(url, cache_root, ctx.objects, ctx)?), ctx)
        }
        Payload::CheckpointFetch { url, artifacts: Some(_), .. } => crate::remote::list_checkpoint(url, ctx),
        Payload::CheckpointFetch { url, cache_dir, .. } => {
            let cache_root = ctx.objects.cache_dir.as_deref().unwrap_or(cache_dir);
            let mut output = TaskOutput::from_value(&objects::download(url, cache_root, ctx.objects, ctx)?);
            let dir = output.path.clone().unwrap_or_default();
            let checkpoint = open_checkpoint(&dir).map_err(|e| {
                StepError::fatal(format!("{url} is not a checkpoint (`.metadata` and rank files): {e}"))
            })?;
            (ctx.log)(format!(
                "checkpoint ok: {} tensors, {} bytes items",
                checkpoint.tensors.len(),
                checkpoint.objects.len()
            ));
            if let Some(m) = output.source.as_mut().and_then(serde_json::Value::as_object_mut) {
                m.insert("kind".into(), json!("checkpoint.reshard"));
            }
            Ok(output)
        }
        Payload::Reshard { job } => match &job.remote {
            Some(remote) => {
                // Split by rank, the rank tasks put the files of a source read in place.
                if job.split {
                    if let Some(output) = crate::remote_reshard::commit(job, remote, ctx)? {
                        return Ok(output);
                    }
                }
                let needs: Vec<&str> = match &job.source {
                    shardline_control::graph::ReshardSource::Task { task } => vec![task.as_str()],
                    shardline_control::graph::ReshardSource::Local { .. } => vec![],
                };
                let needs = needs.into_iter().chain(job.release_task.as_deref()).collect::<Vec<_>>();
                // Otherwise written whole here, staged in the scratch and put.
                crate::remote::staged_step(ctx, &needs, remote, ".metadata", |ctx, out| {
                    let whole = shardline_control::graph::ReshardJob { out, split: false, ..job.clone() };
                    checkpoints::reshard(&whole, ctx)
                })
            }
            None => checkpoints::reshard(job, ctx),
        },
        Payload::ReshardRank { job, rank } => match &job.remote {
            Some(remote) => crate::remote_reshard::rank(job, *rank, remote, ctx),
            None => checkpoints::reshard_rank(job, *rank, ctx),
        },
        Payload::Command { job } => match &job.remote {
            Some(remote) => {
                let needs: Vec<&str> = job.inputs.iter().map(|i| i.task.as_str()).collect();
                crate::remote::staged_step(ctx, &needs, remote, "", |ctx, out| {
                    crate::command::run(&shardline_control::graph::CommandJob { out, ..job.clone() }, ctx)
                })
            }
            None => crate::command::run(job, ctx),
        },
        Payload::Export { job } => match &job.remote {
            Some(remote) => {
                let needs = [Some(job.checkpoint_task.as_str()), job.release_task.as_deref()];
                let needs: Vec<&str> = needs.into_iter().flatten().collect();
                // The model's items only, not the whole checkpoint: the moments are most of it.
                let mut outputs = ctx.outputs.clone();
                if let Some(o) = outputs.get_mut(&job.checkpoint_task) {
                    if let (Some(url), false) = (o.artifact.clone(), o.dir.as_ref().is_some_and(|d| d.exists())) {
                        let dir = ctx.scratch.join("checkpoint");
                        let prefix = job.prefix.as_str();
                        o.dir =
                            Some(crate::sparse_checkpoint::fetch_sparse(&url, |k| k.starts_with(prefix), &dir, ctx)?);
                    }
                }
                let ctx = &StepContext { outputs: &outputs, ..*ctx };
                crate::remote::staged_step(ctx, &needs, remote, "config.json", |ctx, out| {
                    checkpoints::export(&shardline_control::graph::ExportJob { out, ..job.clone() }, ctx)
                })
            }
            None => checkpoints::export(job, ctx),
        },
        // Split only on a local or shared file system (see `graph::export_tasks`).
        Payload::ExportPart { job, part } => checkpoints::export_part(job, *part, ctx),
        Payload::Plan { job } => {
            let dialect = job_dialect(job)?;
            if job.remote.is_some() && !matches!(dialect, Dialect::FsdpDtensor | Dialect::TorchDist) {
                return Err(StepError::fatal(format!(
                    "`target: {}` is written to local artifacts only for now; this server keeps its artifacts in an object store (run it without `--artifacts`, or use `target: fsdp_dtensor` or `torch_dist`)",
                    dialect.name()
                )));
            }
            let plan = match job.remote {
                Some(_) => crate::remote::plan(job, ctx)?,
                None => job_plan(job, &open_release(&ctx.source_path(&job.source_task)?)?)?,
            };
            let staging = staging_dir(job);
            let root = staging_root(job);
            // A previous attempt's partial output is discarded; rank files are rewritten whole.
            if job.remote.is_some() {
                // Nothing is staged: rank files go to the artifact store.
            } else if root.exists() {
                fs::remove_dir_all(&root).map_err(|e| StepError::transient(format!("{}: {e}", root.display())))?;
            }
            if job.remote.is_none() {
                fs::create_dir_all(&staging)
                    .map_err(|e| StepError::transient(format!("{}: {e}", staging.display())))?;
            }
            let per_rank = plan.bytes_per_rank();
            (ctx.log)(format!(
                "planned {} keys on {} ({} ranks, {} bytes); unconverted: {}",
                plan.tensors.len(),
                plan.mesh,
                plan.world(),
                per_rank.iter().sum::<u64>(),
                plan.unconverted.len()
            ));
            Ok(TaskOutput {
                plan_digest: Some(plan_digest(&plan)),
                mesh: Some(plan.mesh.to_string()),
                world: Some(plan.world()),
                keys: Some(plan.tensors.len() as u64),
                bytes_per_rank: Some(per_rank),
                split_fused: Some(job.split_fused),
                ..TaskOutput::default()
            }
            .with("unconverted", json!(plan.unconverted)))
        }
        Payload::Rank { job, plan_task, rank } => {
            if is_cached(ctx, plan_task)?.is_some() {
                (ctx.log)("served from cache".into());
                return Ok(TaskOutput { cached: Some(json!(true)), ..TaskOutput::default() });
            }
            if job.remote.is_some() {
                return crate::rank_task::rank(job, plan_task, *rank, ctx);
            }
            let (release, plan) = checked_plan(ctx, job, plan_task)?;
            let staging = staging_dir(job);
            let bytes = execute::write_rank_file(&plan, &release, &staging, *rank, &exec_options(job), ctx.progress)
                .map_err(|e| StepError::transient(e.to_string()))?;
            (ctx.log)(format!("wrote rank {rank}: {bytes} bytes"));
            Ok(TaskOutput { bytes: Some(bytes), ..TaskOutput::default() }.with("rank", json!(rank)))
        }
        Payload::Commit { job, plan_task } => {
            if let Some(cached) = is_cached(ctx, plan_task)? {
                (ctx.log)("served from cache".into());
                return Ok(cached);
            }
            if job.remote.is_some() {
                return crate::remote::commit(job, plan_task, ctx);
            }
            let (release, plan) = checked_plan(ctx, job, plan_task)?;
            let (staging, root) = (staging_dir(job), staging_root(job));
            if job.out.exists() && committed_checkpoint(&job.out) && !root.exists() {
                // A previous attempt committed and then lost its lease before reporting.
                (ctx.log)("already committed by a previous attempt".into());
            } else {
                execute::commit_checkpoint(&plan, &staging, &exec_options(job))
                    .map_err(|e| StepError::transient(e.to_string()))?;
                if job_dialect(job)? == Dialect::TorchDist {
                    let config =
                        ModelConfig::from_json(release.config_json()).map_err(|e| StepError::fatal(e.to_string()))?;
                    let args = SeedArgs::for_model(&config, release.config_json(), plan.mesh, job.vocab_divisible_by);
                    save_dir::finish_seed_save(&root, &args).map_err(|e| StepError::transient(e.to_string()))?;
                }
                if job.out.exists() {
                    fs::remove_dir_all(&job.out)
                        .map_err(|e| StepError::transient(format!("{}: {e}", job.out.display())))?;
                }
                fs::rename(&root, &job.out).map_err(|e| StepError::transient(format!("{}: {e}", job.out.display())))?;
            }
            (ctx.log)(format!("committed {}", job.out.display()));
            Ok(TaskOutput {
                dir: Some(job.out.clone()),
                mesh: Some(plan.mesh.to_string()),
                world: Some(plan.world()),
                keys: Some(plan.tensors.len() as u64),
                bytes: Some(plan.bytes_per_rank().iter().sum::<u64>()),
                split_fused: Some(job.split_fused),
                ..TaskOutput::default()
            }
            .with("format", json!(job.format))
            .with("target", json!(job_dialect(job)?.name())))
        }
        Payload::SplitPassThrough { checkpoint_task } => {
            let out = ctx
                .output(checkpoint_task)?
                .clone()
                .with("split", json!("applied in the shard plan: no bytes were rewritten"));
            (ctx.log)("fused projections were split by the shard plan (plan exchanged, no intermediate output)".into());
            Ok(out)
        }
        Payload::Validate { checkpoint_task, source_task, prefix, parts } => {
            crate::validate::validate(checkpoint_task, source_task, prefix, parts, ctx)
        }
        Payload::ValidatePart { checkpoint_task, source_task, prefix, part, parts } => {
            crate::validate::part(checkpoint_task, source_task, prefix, (*part, *parts), ctx)
        }
        Payload::Upload { checkpoint_task, source_task, to, .. } => {
            let dir = checkpoint_dir(ctx, checkpoint_task)?;
            let dest = to.as_str();
            // A Hub download names its source (repository, commit); a local one is described by its
            // output. Without a download upstream (a reshard of a `path`), the checkpoint's task
            // names it.
            let source = ctx.output(source_task.as_deref().unwrap_or(checkpoint_task))?;
            let source = source.source.clone().unwrap_or_else(|| source.to_value());
            let layout = ctx.output(checkpoint_task)?.to_value();
            // Object stores are reached through object_store, configured from the environment.
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| StepError::transient(format!("starting the upload runtime: {e}")))?;
            let options = shardline_publish::PublishOptions::default();
            let (manifest, report) = runtime
                .block_on(shardline_publish::publish(&dir, dest, source, layout, &options))
                .map_err(|e| StepError::transient(e.to_string()))?;
            (ctx.log)(format!(
                "published {} files to {} ({} copied, {} unchanged, {} bytes)",
                manifest.files.len(),
                dest,
                report.copied.len(),
                report.skipped.len(),
                report.bytes_copied
            ));
            Ok(TaskOutput {
                files: Some(manifest.files.len() as u64),
                bytes: Some(report.bytes_copied),
                dest: Some(dest.to_string()),
                manifest_url: Some(format!("{}/{}", dest.trim_end_matches('/'), shardline_publish::MANIFEST)),
                published_bytes: Some(manifest.files.iter().map(|f| f.size).sum()),
                ..TaskOutput::default()
            }
            .with("copied", json!(report.copied.len()))
            .with("skipped", json!(report.skipped.len())))
        }
    }
}

/// The checkpoint (or exported release) a task recorded, as a local directory: its `dir`, else
/// its artifact prefix read into the worker's object cache.
pub(crate) fn checkpoint_dir(ctx: &StepContext, task: &str) -> Result<PathBuf, StepError> {
    let output = ctx.output(task)?;
    if let Some(dir) = &output.dir {
        return Ok(dir.clone());
    }
    crate::remote::materialize(output, ctx)?
        .ok_or_else(|| StepError::fatal(format!("task `{task}` did not report a checkpoint directory")))
}

/// Parses `tp2·cp1·dp4·ep1·etp2` (the mesh's display form).
pub fn parse_mesh(s: &str) -> Option<Mesh> {
    let mut m = Mesh::new(1, 1, 1, 1);
    for part in s.split('·') {
        let (name, n) = part.split_at(part.find(|c: char| c.is_ascii_digit())?);
        let n: u64 = n.parse().ok()?;
        match name {
            "tp" => m.tp = n,
            "cp" => m.cp = n,
            "dp" => m.dp = n,
            "ep" => m.ep = n,
            "etp" => m.etp = n,
            _ => return None,
        }
    }
    Some(m)
}
