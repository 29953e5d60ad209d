//! The `checkpoint.validate` step: a checkpoint read back and compared, bit for bit, with the
//! release it was made from.
//!
//! On a local work directory one task reads it whole. On an object-store artifact store it is
//! split by rank file, so no worker reads the whole checkpoint or the whole release: each part
//! fetches the checkpoint's index (`.metadata`, or the headers of a DCP-safetensors checkpoint's
//! files), its own files and the release byte ranges their items are made from (a release file
//! whole only when its worker's parts need half of it), and checks those items; the validation
//! task then reads the index alone and checks that the parts' items add up to it, every declared
//! chunk stored exactly once.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use serde_json::json;
use shardline_artifacts::{Artifacts, ListedObject};
use shardline_control::graph::part_files;
use shardline_control::{BoxFingerprint, TaskOutput};
use shardline_formats::checkpoint::{resolve_checkpoint_dir, torchtitan_target_of};
use shardline_formats::execute::SourceMap;
use shardline_formats::safetensors::Release;
use shardline_formats::training::common_state::is_torch_dist;
use shardline_formats::verify::{
    part_ranges, parts_agree, verify_checkpoint, BoxSet, Scope, VerifyError, VerifyOptions, VerifyReport,
};
use shardline_layout::{build_plan, Dialect, Mesh, ModelConfig, Plan, PlanOptions, SourceTensor};

use crate::rank_task::{read_whole_files, SparseRelease};
use crate::remote::{checkpoint_in, open_artifacts, stage_release, transient};
use crate::steps::{checkpoint_dir, open_release, parse_mesh, StepContext, StepError};

/// Bytes a first read of a safetensors header takes (most headers of rank files are shorter).
const HEADER_FIRST_READ: u64 = 1 << 20;

/// A validation task: the whole checkpoint, or (with `parts`) its index against what its parts
/// found.
pub fn validate(
    checkpoint_task: &str,
    source_task: &str,
    prefix: &str,
    parts: &[String],
    ctx: &StepContext,
) -> Result<TaskOutput, StepError> {
    if !parts.is_empty() {
        return declared(checkpoint_task, source_task, prefix, parts, ctx);
    }
    let dir = checkpoint_dir(ctx, checkpoint_task)?;
    // A Megatron save directory (torch_dist): the checkpoint its tracker names.
    let ckpt = resolve_checkpoint_dir(&dir).map_err(|e| StepError::fatal(e.to_string()))?;
    let release = open_release(&ctx.source_path(source_task)?)?;
    let dialect = if is_torch_dist(&ckpt) {
        Dialect::TorchDist
    } else {
        match torchtitan_target_of(&ckpt).map_err(|e| StepError::fatal(e.to_string()))? {
            Some(target) => Dialect::Torchtitan(target),
            None => Dialect::FsdpDtensor,
        }
    };
    let reference = reference(&release, prefix, checkpoint_task, dialect, ctx)?;
    let report = verify(&ckpt, &release, &reference, Scope::Whole, ctx)?;
    (ctx.log)(format!("{} tensors, {} bytes reconstructed bit-exactly", report.tensors, report.bytes_checked));
    Ok(TaskOutput { dir: Some(dir), bytes_checked: Some(report.bytes_checked), ..TaskOutput::default() }
        .with("ok", json!(true))
        .with("tensors", json!(report.tensors)))
}

/// Part `part` of `parts` of a validation on an artifact store: the items of its files.
pub fn part(
    checkpoint_task: &str,
    source_task: &str,
    prefix: &str,
    (part, parts): (u64, u64),
    ctx: &StepContext,
) -> Result<TaskOutput, StepError> {
    let (url, dialect) = checkpoint_url(checkpoint_task, ctx)?;
    let release_dir = ctx.scratch.join("release");
    let staged = stage_release(ctx.output(source_task)?, &release_dir, ctx)?;
    let reference = reference(&staged.release, prefix, checkpoint_task, dialect, ctx)?;
    let checkpoint = open_artifacts(&url, ctx)?;
    let listing = ctx.runtime.block_on(checkpoint.list()).map_err(transient)?;
    let names: Vec<String> = listing.iter().map(|o| o.name.clone()).collect();
    let files: BTreeSet<String> = part_files(&names, part, parts).into_iter().collect();
    let dir = ctx.scratch.join("checkpoint");
    let fetched = ctx.runtime.block_on(fetch_checkpoint(&checkpoint, &listing, &files, &dir))?;
    let ranges = part_ranges(&dir, &staged.release, &reference, &files).map_err(|e| verify_error(e, &dir))?;
    let release_names: Vec<String> = SourceMap::new(&reference, &staged.release)
        .map_err(|e| StepError::fatal(e.to_string()))?
        .file_paths()
        .map(|p| p.strip_prefix(&release_dir).unwrap_or(p).to_string_lossy().into_owned())
        .collect();
    let release_bytes = read_whole_files(ctx, &staged, &release_names, &ranges, parts)?
        + SparseRelease { ctx, staged: &staged, names: &release_names, release_dir: &release_dir }.fetch(&ranges)?;
    let report = verify(&dir, &staged.release, &reference, Scope::Files(&files), ctx)?;
    (ctx.log)(format!(
        "part {part} of {parts}: {} items of {} file(s) checked, {} bytes bit-exact; fetched {fetched} checkpoint bytes \
         and {release_bytes} release bytes ({} ranges)",
        report.items,
        files.len(),
        report.bytes_checked,
        ranges.len()
    ));
    let held = BoxFingerprint { count: report.held.count, sum: format!("{:032x}", report.held.sum) };
    Ok(TaskOutput { bytes_checked: Some(report.bytes_checked), boxes_held: Some(held), ..TaskOutput::default() }
        .with("files", json!(files)))
}

/// The validation task of a split validation: the index alone, and the parts' items summed.
fn declared(
    checkpoint_task: &str,
    source_task: &str,
    prefix: &str,
    parts: &[String],
    ctx: &StepContext,
) -> Result<TaskOutput, StepError> {
    let (url, dialect) = checkpoint_url(checkpoint_task, ctx)?;
    let staged = stage_release(ctx.output(source_task)?, &ctx.scratch.join("release"), ctx)?;
    let reference = reference(&staged.release, prefix, checkpoint_task, dialect, ctx)?;
    let dir = ctx.scratch.join("checkpoint");
    let checkpoint = open_artifacts(&url, ctx)?;
    ctx.runtime.block_on(async {
        let listing = checkpoint.list().await.map_err(transient)?;
        fetch_checkpoint(&checkpoint, &listing, &BTreeSet::new(), &dir).await
    })?;
    let report = verify(&dir, &staged.release, &reference, Scope::Declared, ctx)?;
    let mut held = Vec::new();
    let mut bytes_checked = 0;
    for task in parts {
        let output = ctx.output(task)?;
        let boxes = output
            .boxes_held
            .as_ref()
            .and_then(|b| u128::from_str_radix(&b.sum, 16).ok().map(|sum| BoxSet { count: b.count, sum }));
        held.push(boxes.ok_or_else(|| StepError::fatal(format!("`{task}` recorded no fingerprint of its items")))?);
        bytes_checked += output.bytes_checked.unwrap_or(0);
    }
    if let Some(f) = parts_agree(&report, held) {
        return Err(StepError::fatal(format!("checkpoint {url}: {}", f.message)));
    }
    (ctx.log)(format!(
        "{} tensors, {} bytes reconstructed bit-exactly by {} parts; every declared chunk stored exactly once",
        report.tensors,
        bytes_checked,
        parts.len()
    ));
    let artifact = ctx.output(checkpoint_task)?.artifact.clone();
    Ok(TaskOutput { artifact, bytes_checked: Some(bytes_checked), ..TaskOutput::default() }
        .with("ok", json!(true))
        .with("tensors", json!(report.tensors)))
}

/// Fetches into `dir` what validating the files `whole` of the checkpoint `listing` lists reads:
/// those files, and its index — `.metadata`, or, for a DCP-safetensors checkpoint, every other
/// file's header in a sparse file of the file's size. Returns the bytes fetched.
async fn fetch_checkpoint(
    checkpoint: &Artifacts,
    listing: &[ListedObject],
    whole: &BTreeSet<String>,
    dir: &Path,
) -> Result<u64, StepError> {
    fs::create_dir_all(dir).map_err(|e| transient(format!("{}: {e}", dir.display())))?;
    let has_metadata = listing.iter().any(|o| o.name == ".metadata");
    let mut fetched = 0;
    for o in listing {
        let (path, tag) = (dir.join(&o.name), o.e_tag.as_deref());
        if o.name == ".metadata" || whole.contains(&o.name) {
            fetched += checkpoint.fetch_whole(&o.name, tag, &path).await.map_err(transient)?;
        } else if !has_metadata && o.name.ends_with(".safetensors") {
            fetched += fetch_header(checkpoint, o, &path).await?;
        }
    }
    Ok(fetched)
}

/// A safetensors object's header (its length and JSON) into a sparse file of the object's size:
/// a first read of up to [`HEADER_FIRST_READ`] bytes, and the rest of a longer header.
async fn fetch_header(checkpoint: &Artifacts, object: &ListedObject, path: &Path) -> Result<u64, StepError> {
    let io = |e: std::io::Error| transient(format!("{}: {e}", path.display()));
    let file = fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path).map_err(io)?;
    file.set_len(object.size).map_err(io)?;
    let file = Arc::new(file);
    let tag = object.e_tag.as_deref();
    let first = object.size.min(HEADER_FIRST_READ);
    let mut fetched =
        checkpoint.fetch_ranges(&object.name, tag, &[(0, first)], file.clone()).await.map_err(transient)?;
    let mut len = [0u8; 8];
    if first >= 8 {
        file.read_exact_at(&mut len, 0).map_err(io)?;
    }
    // A length past the object is the reader's to report; fetch no more than the object holds.
    let end = 8u64.saturating_add(u64::from_le_bytes(len)).min(object.size);
    if end > first {
        fetched += checkpoint.fetch_ranges(&object.name, tag, &[(first, end)], file).await.map_err(transient)?;
    }
    Ok(fetched)
}

/// The checkpoint the task `task` recorded in the artifact store, and its dialect: a Megatron-LM
/// save directory's (`torch_dist`) is the checkpoint directory its tracker names.
fn checkpoint_url(task: &str, ctx: &StepContext) -> Result<(String, Dialect), StepError> {
    let url = ctx
        .output(task)?
        .artifact
        .as_deref()
        .ok_or_else(|| StepError::fatal(format!("task `{task}` recorded no artifact prefix to validate")))?;
    let (url, save_dir) = checkpoint_in(url, ctx)?;
    Ok((url, if save_dir { Dialect::TorchDist } else { Dialect::FsdpDtensor }))
}

/// The release's tensors as the checkpoint of `checkpoint_task` must hold them.
fn reference(
    release: &Release,
    prefix: &str,
    checkpoint_task: &str,
    dialect: Dialect,
    ctx: &StepContext,
) -> Result<Plan, StepError> {
    let checkpoint = ctx.output(checkpoint_task)?;
    let split = checkpoint.split_fused.unwrap_or(true) || dialect == Dialect::TorchDist;
    let config = ModelConfig::from_json(release.config_json()).map_err(|e| StepError::fatal(e.to_string()))?;
    let options = PlanOptions {
        prefix: prefix.to_string(),
        vocab_divisible_by: 1,
        // Optimizer state is expected when the checkpoint has any (see verify_checkpoint);
        // torch_dist checkpoints are written without.
        optimizer_state: dialect == Dialect::FsdpDtensor,
        split_fused: split,
        dialect,
        ..PlanOptions::default()
    };
    let sources = release
        .tensors()
        .map(|t| SourceTensor { name: t.info.name.clone(), dtype: t.info.dtype, shape: t.info.shape.clone() })
        .collect();
    // The unsplit form depends on tp: validate against the mesh it was written for. The split
    // form depends on no mesh but for parameters fused per expert-TP rank (gpt-oss's expert
    // fc1): the written etp.
    let mesh = match checkpoint.mesh.as_deref().and_then(parse_mesh) {
        Some(m) if !split => m,
        Some(m) => Mesh { tp: 1, cp: 1, dp: m.etp, ep: 1, etp: m.etp },
        None => Mesh::new(1, 1, 1, 1),
    };
    build_plan(&config, sources, mesh, &options).map_err(|e| StepError::fatal(format!("{e:?}")))
}

/// Runs a validation of `scope` with the task's CPUs; findings fail the task, the first 50 logged.
fn verify(
    dir: &Path,
    release: &Release,
    reference: &Plan,
    scope: Scope<'_>,
    ctx: &StepContext,
) -> Result<VerifyReport, StepError> {
    let optimizer_prefix = PlanOptions::default().optimizer_prefix;
    // Only the CPUs the task leased: other tasks share this worker.
    let options = VerifyOptions { optional_prefix: Some(&optimizer_prefix), threads: ctx.cpus.max(1) as usize, scope };
    let report =
        verify_checkpoint(dir, release, reference, &options, ctx.progress).map_err(|e| verify_error(e, dir))?;
    if report.ok() {
        return Ok(report);
    }
    for f in report.findings.iter().take(50) {
        (ctx.log)(format!("`{}`: {}", f.key, f.message));
    }
    let first = report.findings.first().map_or_else(String::new, |f| format!("; first: `{}`: {}", f.key, f.message));
    Err(StepError::fatal(format!(
        "checkpoint {} differs from its source in {} place(s){first}",
        dir.display(),
        report.findings.len() as u64 + report.findings_dropped
    )))
}

fn verify_error(e: VerifyError, dir: &Path) -> StepError {
    match e {
        VerifyError::Execute(_) => StepError::transient(e.to_string()),
        _ => StepError::fatal(format!("{}: {e}", dir.display())),
    }
}
