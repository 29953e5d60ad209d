//! `checkpoint.reshard` and `checkpoint.export`: a checkpoint re-tiled for another mesh, and a
//! checkpoint's model weights written back as the HF release they came from. The planning both
//! need beyond the layout crate (the reshard options merged from the checkpoint's `args` and its
//! geometry, the export plan from the release's config and headers, how a checkpoint's model is
//! opened for export) lives in `shardline-ops` once; here the steps add what the pipeline knows.
//!
//! A reshard is written into `<out>.partial` (`.metadata` last) and renamed to `<out>` once
//! complete; an export is staged beside its directory and renamed by the writer. A killed worker
//! never leaves a partial output under the name later steps read.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use shardline_control::graph::{ExportJob, ReshardJob, ReshardSource};
use shardline_control::TaskOutput;
use shardline_formats::checkpoint::open_checkpoint;
use shardline_formats::safetensors::Release;
use shardline_formats::training::{ExportReport, TrainingCheckpoint, TrainingError};
use shardline_layout::dialect::Dialect;
use shardline_layout::reshard::{plan_reshard, RngPolicy};
use shardline_layout::{Mesh, ModelConfig};

use shardline_formats::error_message;
use shardline_ops::{
    automodel_release, inferred_mesh, plan_export_of, reshard_options, saved_etp, ExportRequest, OpenedCheckpoint,
    OpsError, PlannedExport, PlannedReshard, ReshardHints,
};

use crate::steps::{parse_mesh, StepContext, StepError};

/// Digest of a directory's entries (names, sizes, modification times; symlinks followed): what
/// the step cache keys of reshards and exports read of their inputs. Cheap, and changes whenever
/// a file is replaced. A Megatron-LM save directory's entries include the checkpoint directory
/// its tracker names.
pub fn dir_digest(dir: &Path) -> Result<String, StepError> {
    let io = |e: std::io::Error| StepError::transient(format!("{}: {e}", dir.display()));
    let mut entries: Vec<(String, u64, i64, i64)> = Vec::new();
    let named = shardline_formats::checkpoint::megatron_checkpoint_dir(dir).ok().flatten();
    let named_rel = named.as_ref().and_then(|d| d.file_name()).map(|n| format!("{}/", n.to_string_lossy()));
    for (listed, rel) in [(Some(dir.to_path_buf()), String::new()), (named, named_rel.unwrap_or_default())] {
        let Some(listed) = listed else { continue };
        for entry in fs::read_dir(&listed).map_err(io)? {
            let entry = entry.map_err(io)?;
            let meta = fs::metadata(entry.path()).map_err(io)?;
            if meta.is_file() {
                entries.push((
                    format!("{rel}{}", entry.file_name().to_string_lossy()),
                    meta.len(),
                    meta.mtime(),
                    meta.mtime_nsec(),
                ));
            }
        }
    }
    entries.sort();
    let mut h = Sha256::new();
    h.update(b"shardline directory\0");
    for (name, len, secs, nanos) in entries {
        h.update(format!("{name}\0{len}\0{secs}.{nanos}\0").as_bytes());
    }
    Ok(hex::encode(h.finalize()))
}

/// The directory a reshard reads: its `path`, or the directory an earlier task reports.
pub fn reshard_source_dir(job: &ReshardJob, outputs: &BTreeMap<String, TaskOutput>) -> Result<PathBuf, StepError> {
    match &job.source {
        ReshardSource::Local { path } => Ok(path.clone()),
        ReshardSource::Task { task } => {
            let out = outputs
                .get(task)
                .ok_or_else(|| StepError::transient(format!("output of task `{task}` is not available")))?;
            out.dir
                .clone()
                .or_else(|| out.path.clone())
                .ok_or_else(|| StepError::fatal(format!("task `{task}` did not report a checkpoint directory")))
        }
    }
}

fn version_key(h: &mut Sha256, what: &str, step_hash: &str) {
    h.update(what.as_bytes());
    h.update(b"\0");
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    h.update(b"\0");
    h.update(step_hash.as_bytes());
}

/// The step-cache key of a reshard: its fields and what its source directory holds.
pub fn reshard_cache_key(job: &ReshardJob, source_digest: &str) -> String {
    let mut h = Sha256::new();
    version_key(&mut h, "shardline checkpoint.reshard", &job.step_hash);
    let fields = json!([job.mesh_text(), job.rng, job.vocab_size, job.from_mesh, job.vocab_divisible_by]);
    h.update(fields.to_string().as_bytes());
    // The target only when set, so keys made before it existed still serve.
    if let Some(target) = &job.target {
        h.update(format!("\0target {target}").as_bytes());
    }
    h.update(source_digest.as_bytes());
    crate::steps::artifact_root_key(&mut h, job.remote.as_deref());
    hex::encode(h.finalize())
}

/// The step-cache key of an export: its fields, the checkpoint's and the release's directories.
pub fn export_cache_key(job: &ExportJob, checkpoint_digest: &str, like_digest: &str) -> String {
    let mut h = Sha256::new();
    version_key(&mut h, "shardline checkpoint.export", &job.step_hash);
    h.update(json!([job.etp, job.max_file_size, job.prefix]).to_string().as_bytes());
    h.update(checkpoint_digest.as_bytes());
    h.update(b"\0");
    h.update(like_digest.as_bytes());
    hex::encode(h.finalize())
}

/// The step-cache key of an export on a local or shared file system, from the directories of
/// its checkpoint and release (without a release, the checkpoint's own description, inside it).
pub fn local_export_cache_key(job: &ExportJob, outputs: &BTreeMap<String, TaskOutput>) -> Result<String, StepError> {
    let checkpoint = outputs.get(&job.checkpoint_task).and_then(|o| o.dir.clone());
    let like = export_like(job, outputs)?;
    let checkpoint = checkpoint.ok_or_else(|| StepError::fatal("the checkpoint's task reports no directory"))?;
    let like = like.map(|l| dir_digest(&l)).transpose()?.unwrap_or_default();
    Ok(export_cache_key(job, &dir_digest(&checkpoint)?, &like))
}

/// The release an export reproduces: its `like`, else the upstream download's directory; `None`
/// when the checkpoint has to describe its own (a NeMo Automodel save's `model/.hf_metadata/`).
pub fn export_like(job: &ExportJob, outputs: &BTreeMap<String, TaskOutput>) -> Result<Option<PathBuf>, StepError> {
    if let Some(like) = &job.like {
        return Ok(Some(like.clone()));
    }
    let Some(task) = job.release_task.as_deref() else { return Ok(None) };
    outputs
        .get(task)
        .ok_or_else(|| StepError::transient(format!("output of task `{task}` is not available")))?
        .path
        .clone()
        .map(Some)
        .ok_or_else(|| StepError::fatal(format!("task `{task}` did not report a source path")))
}

/// Whether a remembered export still describes a complete HF directory.
pub fn cached_export_usable(output: &TaskOutput) -> bool {
    output.dir.as_deref().is_some_and(|d| Release::open(d).is_ok())
}

fn rng_policy(name: &str) -> Result<RngPolicy, StepError> {
    match name {
        "from-rank0" => Ok(RngPolicy::FromRank0),
        "drop" => Ok(RngPolicy::Drop),
        other => Err(StepError::fatal(format!("unknown RNG policy `{other}` (from-rank0, drop)"))),
    }
}

/// The vocabulary size in a release's `config.json`, when the pipeline downloaded one.
fn release_vocab(ctx: &StepContext, task: Option<&str>) -> Option<u64> {
    let dir = ctx.outputs.get(task?)?.path.clone()?;
    let text = fs::read_to_string(dir.join("config.json")).ok()?;
    ModelConfig::from_json(&text).ok().map(|c| c.vocab_size)
}

fn write_error(e: TrainingError) -> StepError {
    match e {
        TrainingError::Write(_) => StepError::transient(e.to_string()),
        other => StepError::fatal(other.to_string()),
    }
}

fn staging(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

pub(crate) fn threads(ctx: &StepContext) -> usize {
    ctx.cpus.max(1) as usize
}

/// The reshard `job` asks for, planned from its source directory (returned with it).
fn plan_job(job: &ReshardJob, ctx: &StepContext) -> Result<(PathBuf, PlannedReshard), StepError> {
    let dir = reshard_source_dir(job, ctx.outputs)?;
    let upstream = match &job.source {
        ReshardSource::Task { task } => ctx.outputs.get(task),
        ReshardSource::Local { .. } => None,
    };
    let mesh = Mesh { tp: job.tp, cp: job.cp, dp: job.dp, ep: job.ep, etp: job.etp };
    let target =
        match job.target.as_deref() {
            None => None,
            Some(t) => Some(Dialect::parse(t).ok_or_else(|| {
                StepError::fatal(format!("unknown target `{t}` (fsdp_dtensor, torch_dist, torchtitan)"))
            })?),
        };
    let rng = rng_policy(&job.rng)?;
    let opened = OpenedCheckpoint::open(&dir, mesh.etp).map_err(|e| StepError::fatal(error_message(&e)))?;
    let planned = match opened.plan_fsdp2(&dir, mesh, target, rng).map_err(|e| StepError::fatal(e.to_string()))? {
        Ok(planned) => planned,
        Err(megatron) => plan_megatron(ctx, job, &dir, megatron, mesh, target, upstream)?,
    };
    Ok((dir, planned))
}

/// Where a reshard staged in `staged` puts its rank files: torchtitan loads the latest `step-N/`
/// of its checkpoint folder, so a torchtitan step keeps its name inside it.
fn write_dir(planned: &PlannedReshard, staged: &Path) -> PathBuf {
    let step = match planned.options.dialect {
        Dialect::Torchtitan(_) => torchtitan_step_name(&planned.source.checkpoint.dir),
        _ => None,
    };
    step.map_or_else(|| staged.to_path_buf(), |s| staged.join(s))
}

fn output_error(e: OpsError) -> StepError {
    match e {
        OpsError::Output { source, .. } => write_error(source),
        other => StepError::fatal(other.to_string()),
    }
}

/// Runs a `checkpoint.reshard.rank` task: target rank file `rank` written into the reshard's
/// staging directory, where its commit (the `checkpoint.reshard` task) finds it.
pub fn reshard_rank(job: &ReshardJob, rank: u64, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    let (_, planned) = plan_job(job, ctx)?;
    let world = planned.plan.mesh.world();
    let out = TaskOutput::default().with("rank", json!(rank));
    if !planned.splits_by_rank() {
        (ctx.log)("a NeMo Automodel save is written whole by the reshard's commit task".into());
        return Ok(out.with("written_by_commit", json!(true)));
    }
    if rank >= world {
        return Err(StepError::fatal(format!(
            "rank {rank} is not in the target mesh {} ({world} ranks)",
            planned.plan.mesh
        )));
    }
    let staged = staging(&job.out);
    if job.out.exists() && open_checkpoint(&job.out).is_ok() && !staged.exists() {
        (ctx.log)("already committed by a previous attempt".into());
        return Ok(out);
    }
    let report = planned
        .write_ranks(&write_dir(&planned, &staged), rank..rank + 1, threads(ctx), ctx.progress)
        .map_err(output_error)?;
    (ctx.log)(format!(
        "wrote rank {rank}'s file of {world} into {}: {} chunks, {} bytes",
        staged.display(),
        report.chunks,
        report.file_bytes
    ));
    Ok(TaskOutput { bytes: Some(report.file_bytes), files: Some(1), ..out })
}

/// Runs a `checkpoint.reshard` task: the whole reshard, or, split by rank, its commit.
pub fn reshard(job: &ReshardJob, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    let (dir, planned) = plan_job(job, ctx)?;
    let upstream = match &job.source {
        ReshardSource::Task { task } => ctx.outputs.get(task),
        ReshardSource::Local { .. } => None,
    };
    let plan = &planned.plan;
    let mesh = plan.mesh;
    for note in &plan.notes {
        (ctx.log)(format!("warning: {}", note.strip_prefix("warning: ").unwrap_or(note)));
    }
    let from = planned.options.source_mesh;
    let from = from.map_or_else(|| "unknown".to_string(), |m| m.to_string());
    let total = planned.total_bytes();
    ctx.bytes_total.store(total, Ordering::Relaxed);
    let moments = planned.optimizer_states();
    (ctx.log)(format!(
        "resharding {} ({from}) → {mesh}: {} tensors ({moments} optimizer states), {} bytes items, {total} bytes",
        dir.display(),
        planned.tensor_count(),
        plan.objects.len()
    ));
    let out = &job.out;
    let staged = staging(out);
    let io = |p: &Path, e: std::io::Error| StepError::transient(format!("{}: {e}", p.display()));
    let mut file_bytes = None;
    if out.exists() && open_checkpoint(out).is_ok() && !staged.exists() {
        // A previous attempt renamed its output into place and then lost its lease.
        (ctx.log)("already written by a previous attempt".into());
    } else {
        let write_to = write_dir(&planned, &staged);
        let report = if job.split && planned.splits_by_rank() {
            // The rank tasks wrote the files into the staging directory.
            let report = planned.commit(&write_to).map_err(output_error)?;
            (ctx.log)(format!("committed {} rank files written by the rank tasks", report.files));
            report
        } else {
            if staged.exists() {
                fs::remove_dir_all(&staged).map_err(|e| io(&staged, e))?;
            }
            if let Some(parent) = staged.parent() {
                fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
            }
            planned.write(&write_to, threads(ctx), true, ctx.progress).map_err(output_error)?
        };
        if !report.args_missing.is_empty() {
            (ctx.log)(format!("warning: `args` has no {}; left as they were", report.args_missing.join(", ")));
        }
        if out.exists() {
            fs::remove_dir_all(out).map_err(|e| io(out, e))?;
        }
        fs::rename(&staged, out).map_err(|e| io(out, e))?;
        if let Some(parent) = out.parent() {
            if let Ok(d) = fs::File::open(parent) {
                let _ = d.sync_all();
            }
        }
        file_bytes = Some(report.file_bytes);
    }
    let bytes = match file_bytes {
        Some(b) => b,
        None => dir_bytes(out),
    };
    ctx.progress.bytes_written.store(total, Ordering::Relaxed);
    (ctx.log)(format!("resharded into {} ({} rank files, {bytes} bytes)", out.display(), mesh.world()));
    Ok(reshard_output(job, &planned, &dir, upstream, bytes))
}

/// What a reshard task reports: the checkpoint (`dir`: the step's `out`; on an artifact store the
/// caller names the prefix instead), its mesh and size, what it was made from.
pub(crate) fn reshard_output(
    job: &ReshardJob,
    planned: &PlannedReshard,
    source_dir: &Path,
    upstream: Option<&TaskOutput>,
    bytes: u64,
) -> TaskOutput {
    let (plan, dialect) = (&planned.plan, planned.options.dialect);
    let mesh = plan.mesh;
    let from = planned.options.source_mesh.map_or_else(|| "unknown".to_string(), |m| m.to_string());
    // What a publish of this checkpoint records as its source when the pipeline downloaded none.
    let source_record = match (&job.source, upstream) {
        (ReshardSource::Local { path }, _) => json!({"kind": "checkpoint.reshard", "path": path}),
        (ReshardSource::Task { .. }, Some(o)) => match o.source.clone() {
            Some(mut s) => {
                if let Some(m) = s.as_object_mut() {
                    m.insert("kind".into(), json!("checkpoint.reshard"));
                }
                s
            }
            None => json!({"kind": "checkpoint.reshard", "checkpoint": source_dir}),
        },
        (ReshardSource::Task { .. }, None) => Value::Null,
    };
    TaskOutput {
        dir: Some(job.out.clone()),
        mesh: Some(mesh.to_string()),
        world: Some(mesh.world()),
        keys: Some(planned.tensor_count() as u64),
        bytes: Some(bytes),
        split_fused: Some(true),
        source: (!source_record.is_null()).then_some(source_record),
        ..TaskOutput::default()
    }
    .with("format", json!("dcp"))
    .with("target", json!(dialect.name()))
    .with("from", json!(from))
    .with("optimizer_states", json!(planned.optimizer_states()))
    .with("notes", json!(plan.notes))
}

fn dir_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|rd| rd.filter_map(Result::ok).filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

/// The export `job` asks for, planned, with the task output of the checkpoint it reads.
fn plan_export_job<'o>(job: &ExportJob, ctx: &StepContext<'o>) -> Result<(PlannedExport, &'o TaskOutput), StepError> {
    let upstream = ctx
        .outputs
        .get(&job.checkpoint_task)
        .ok_or_else(|| StepError::transient(format!("output of task `{}` is not available", job.checkpoint_task)))?;
    let dir = upstream.dir.clone().ok_or_else(|| {
        StepError::fatal(format!("task `{}` did not report a checkpoint directory", job.checkpoint_task))
    })?;
    let like = export_like(job, ctx.outputs)?;
    if like.is_none() && automodel_release(&dir).map_err(|e| StepError::fatal(error_message(&e)))?.is_none() {
        return Err(StepError::fatal(format!(
            "{} describes no release (no NeMo Automodel `model/.hf_metadata/`), and the step has no `like` and no \
             upstream download: set `with.like` to the HF release it came from",
            dir.display()
        )));
    }
    // The expert-TP size the checkpoint was written with: the step's, its `args`', the mesh its
    // task reports (a torch_dist checkpoint's fused parameters are read for 1, `[gate; up]`).
    let etp =
        job.etp.or_else(|| saved_etp(&dir)).or_else(|| upstream.mesh.as_deref().and_then(parse_mesh).map(|m| m.etp));
    let request = ExportRequest {
        ckpt: dir,
        to: job.out.clone(),
        like,
        prefix: job.prefix.clone(),
        etp,
        max_file_bytes: job.max_file_size,
        overwrite: true,
        threads: threads(ctx),
    };
    let planned = plan_export_of(&request).map_err(|e| StepError::fatal(error_message(&e)))?;
    Ok((planned, upstream))
}

/// Runs a `checkpoint.export` task: the whole export, or, split in parts, its commit.
pub fn export(job: &ExportJob, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    let (planned, upstream) = plan_export_job(job, ctx)?;
    let total = planned.total_bytes();
    ctx.bytes_total.store(total, Ordering::Relaxed);
    (ctx.log)(format!(
        "exporting {} as {} (etp {}): {} tensors, {total} bytes, files of at most {} bytes",
        planned.checkpoint.dir.display(),
        planned.like.display(),
        planned.etp,
        planned.tensors.len(),
        job.max_file_size
    ));
    if let Some(parent) = job.out.parent() {
        fs::create_dir_all(parent).map_err(|e| StepError::transient(format!("{}: {e}", parent.display())))?;
    }
    let report = if job.parts > 1 {
        let report = planned.commit().map_err(output_error)?;
        (ctx.log)(format!("committed {} weight files written by {} part tasks", report.files.len(), job.parts));
        ctx.progress.bytes_written.store(total, Ordering::Relaxed);
        report
    } else {
        planned.write(ctx.progress).map_err(output_error)?
    };
    (ctx.log)(format!(
        "exported {} tensors, {} bytes in {} file(s) into {}; copied from the release: {}",
        report.tensors,
        report.bytes,
        report.files.len(),
        job.out.display(),
        if report.copied.is_empty() { "nothing".to_string() } else { report.copied.join(", ") }
    ));
    Ok(export_output(job, upstream, report, &planned.like, planned.etp))
}

/// Runs a `checkpoint.export.part` task: the weight files of part `part` written into the
/// export's staging directory, where its commit (the `checkpoint.export` task) finds them.
pub fn export_part(job: &ExportJob, part: u64, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    let (planned, _) = plan_export_job(job, ctx)?;
    if let Some(parent) = job.out.parent() {
        fs::create_dir_all(parent).map_err(|e| StepError::transient(format!("{}: {e}", parent.display())))?;
    }
    let names = planned.write_part((part, job.parts), ctx.progress).map_err(output_error)?;
    (ctx.log)(format!(
        "wrote part {part} of {}: {} weight file(s){}{}",
        job.parts,
        names.len(),
        if names.is_empty() { "" } else { ": " },
        names.join(", ")
    ));
    Ok(TaskOutput { files: Some(names.len() as u64), ..TaskOutput::default() }
        .with("part", json!(part))
        .with("weights", json!(names)))
}

/// What an export task reports: the HF directory, its files, and the release it followed.
fn export_output(job: &ExportJob, upstream: &TaskOutput, report: ExportReport, like: &Path, etp: u64) -> TaskOutput {
    TaskOutput {
        dir: Some(job.out.clone()),
        bytes: Some(report.bytes),
        files: Some(report.files.len() as u64),
        keys: Some(report.tensors as u64),
        source: upstream.source.clone(),
        ..TaskOutput::default()
    }
    .with("format", json!("hf"))
    .with("like", json!(like))
    .with("etp", json!(etp))
    .with("weights", json!(report.files))
    .with("copied", json!(report.copied))
}

/// The reshard plan of a Megatron checkpoint (`fsdp_dtensor` or `torch_dist`, either translated
/// to the other when `target` says so), with its source mesh and the dialect written.
pub(crate) fn plan_megatron(
    ctx: &StepContext<'_>,
    job: &ReshardJob,
    dir: &Path,
    mut source: TrainingCheckpoint,
    mesh: Mesh,
    target: Option<Dialect>,
    upstream: Option<&TaskOutput>,
) -> Result<PlannedReshard, StepError> {
    let torch_dist = shardline_formats::checkpoint::resolve_checkpoint_dir(dir)
        .is_ok_and(|d| shardline_formats::training::common_state::is_torch_dist(&d));
    // The source's dialect unless the step names another (translation either way).
    let dialect = target.unwrap_or(if torch_dist { Dialect::TorchDist } else { Dialect::FsdpDtensor });
    // torch_dist keeps SwiGLU fc1 whole and the translation splits it.
    if !torch_dist && upstream.and_then(|o| o.split_fused) == Some(false) {
        return Err(StepError::fatal(format!(
            "{} keeps fused projections (no `megatron.split_fused` step follows its shard step); a reshard reads the \
             split form Megatron-FSDP saves: add a `megatron.split_fused` step and reshard its output",
            dir.display()
        )));
    }
    let given = ReshardHints {
        source_mesh: match &job.from_mesh {
            Some(m) => Some(Mesh::parse_assignments(m).map_err(|e| StepError::fatal(format!("from_mesh: {e}")))?),
            None => None,
        },
        vocab_size: job.vocab_size,
        vocab_divisible_by: None,
    };
    let fallback = ReshardHints {
        // The mesh the upstream step wrote, else the chunk geometry's.
        source_mesh: upstream.and_then(|o| o.mesh.as_deref()).and_then(parse_mesh).or_else(|| inferred_mesh(&source)),
        vocab_size: release_vocab(ctx, job.release_task.as_deref()),
        vocab_divisible_by: job.vocab_divisible_by,
    };
    let mut options = reshard_options(&source, mesh, rng_policy(&job.rng)?, given, fallback);
    options.dialect = dialect;
    if dialect == Dialect::TorchDist {
        source.split_fused(options.source_mesh.map(|m| m.etp)).map_err(|e| StepError::fatal(e.to_string()))?;
    }
    let plan = plan_reshard(&source.items, &options)
        .map_err(|e| StepError::fatal(format!("cannot reshard {} to {mesh}: {e}", dir.display())))?;
    Ok(PlannedReshard { source, plan, options, source_mesh_from: "the upstream step or args", automodel: None })
}

/// The `step-N` name of a torchtitan checkpoint directory, when it has one.
fn torchtitan_step_name(dir: &Path) -> Option<std::ffi::OsString> {
    let name = dir.file_name()?;
    name.to_str()?.strip_prefix("step-")?.parse::<u64>().ok()?;
    Some(name.to_os_string())
}
