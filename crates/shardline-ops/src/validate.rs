//! `validate`: a checkpoint reconstructed bit-exactly against the release it came from.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use shardline_formats::checkpoint::{resolve_checkpoint_dir, torchtitan_target_of};
use shardline_formats::execute::Progress;
use shardline_formats::training::common_state::is_torch_dist;
use shardline_formats::verify::{verify_checkpoint, VerifyOptions, VerifyReport};
use shardline_layout::{Dialect, Mesh, Plan, PlanOptions};

use crate::{plan_release, OpsError};

/// What to validate against what.
#[derive(Clone, Debug)]
pub struct ValidateRequest {
    /// The checkpoint (a DCP directory, a Megatron-LM save directory, a torchtitan folder).
    pub ckpt: PathBuf,
    /// The HF release it was converted from.
    pub against: PathBuf,
    /// Prefix of its model keys; `None`: its dialect's.
    pub prefix: Option<String>,
    /// The expert-TP size it was written with (only gpt-oss's fused expert fc1 depends on it).
    pub etp: u64,
}

/// The dialect of the checkpoint in `dir` (already resolved to the directory with the files).
pub fn detect_dialect(dir: &Path) -> Result<Dialect, OpsError> {
    if is_torch_dist(dir) {
        return Ok(Dialect::TorchDist);
    }
    let target =
        torchtitan_target_of(dir).map_err(|source| OpsError::Checkpoint { path: dir.to_path_buf(), source })?;
    Ok(target.map_or(Dialect::FsdpDtensor, Dialect::Torchtitan))
}

/// Validates `request.ckpt`, counting bytes into `progress`. Differences are findings in the
/// report (`ok()` false), not errors; an error means it could not be read at all.
pub fn validate(request: &ValidateRequest, progress: &Progress) -> Result<(VerifyReport, Plan), OpsError> {
    let checkpoint_error = |source| OpsError::Checkpoint { path: request.ckpt.clone(), source };
    let ckpt = resolve_checkpoint_dir(&request.ckpt).map_err(checkpoint_error)?;
    let dialect = detect_dialect(&ckpt)?;
    let defaults = PlanOptions::default();
    let options = PlanOptions {
        prefix: request.prefix.clone().unwrap_or_else(|| dialect.default_prefix().to_string()),
        dialect,
        // The optimizer state of torch_dist checkpoints is not compared yet: none is expected.
        optimizer_state: dialect == Dialect::FsdpDtensor,
        // Global tensors do not depend on the mesh but for vocab padding, which validation
        // accepts as trailing zero rows.
        vocab_divisible_by: 1,
        ..defaults.clone()
    };
    // Any mesh gives the same global tensors but for what is fused per expert-TP rank.
    let etp = request.etp.max(1);
    let mesh = Mesh { tp: 1, cp: 1, dp: etp, ep: 1, etp };
    let (release, reference) = plan_release(&request.against, mesh, &options)?;
    let total = reference.tensors.iter().map(|t| t.shape.iter().product::<u64>() * t.dtype.size() as u64).sum();
    progress.bytes_total.store(total, Ordering::Relaxed);
    let report = verify_checkpoint(
        &ckpt,
        &release,
        &reference,
        &VerifyOptions { optional_prefix: Some(&defaults.optimizer_prefix), ..VerifyOptions::default() },
        progress,
    )
    .map_err(|source| OpsError::Verify { path: request.ckpt.clone(), source })?;
    Ok((report, reference))
}
