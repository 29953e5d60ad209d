//! `reshard`: a training checkpoint saved on one mesh, planned and written for another. The
//! options a reshard takes from what it is told, the checkpoint's `args` and its chunk geometry
//! are merged here once, for the CLI, the pipeline's `checkpoint.reshard` step and Python.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use shardline_formats::checkpoint::{resolve_checkpoint_dir, torchtitan_target};
use shardline_formats::execute::Progress;
use shardline_formats::training::common_state::is_torch_dist;
use shardline_formats::training::{rank_of_file, write_resharded, ReshardReport, TrainingCheckpoint};
use shardline_layout::dialect::Dialect;
use shardline_layout::reshard::{
    infer_mesh, plan_fsdp2_reshard, plan_reshard, Fsdp2Options, ReshardError, ReshardOptions, ReshardPlan, RngPolicy,
};
use shardline_layout::{Mesh, Role};

use crate::OpsError;

/// What a reshard knows of its source besides the checkpoint: each `None` when unknown.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReshardHints {
    pub source_mesh: Option<Mesh>,
    /// The tokenizer's vocabulary size (unpadded).
    pub vocab_size: Option<u64>,
    pub vocab_divisible_by: Option<u64>,
}

/// The options of a reshard of `source` to `mesh`: each value as `given` says, else as the
/// checkpoint's `args` say, else as `fallback` says (the vocab divisor, at last, 128).
pub fn reshard_options(
    source: &TrainingCheckpoint,
    mesh: Mesh,
    rng: RngPolicy,
    given: ReshardHints,
    fallback: ReshardHints,
) -> ReshardOptions {
    let saved = source.args.clone().unwrap_or_default();
    // A translated checkpoint's fused parameters are in the layout it was read for.
    let source_mesh = given.source_mesh.or(saved.mesh()).or(fallback.source_mesh);
    let source_mesh = source_mesh.map(|m| Mesh { etp: source.fused_etp.unwrap_or(m.etp), ..m });
    ReshardOptions {
        mesh,
        source_mesh,
        vocab_size: given.vocab_size.or(saved.vocab_size).or(fallback.vocab_size),
        vocab_divisible_by: given
            .vocab_divisible_by
            .or(saved.make_vocab_size_divisible_by)
            .or(fallback.vocab_divisible_by)
            .unwrap_or(128),
        num_experts: saved.num_experts,
        num_query_groups: saved.num_query_groups,
        rng,
        dialect: Dialect::FsdpDtensor,
    }
}

/// The mesh a checkpoint was saved on, read from its chunk geometry (for a checkpoint without
/// `args`: TP and expert-TP from how row-parallel weights split, the world from the rank files,
/// EP from which ranks hold which experts; CP is folded into DP).
pub fn inferred_mesh(source: &TrainingCheckpoint) -> Option<Mesh> {
    let rank = |i: usize, c: usize| source.chunks_of(i).get(c).and_then(|s| rank_of_file(&s.file));
    infer_mesh(&source.items, rank)
}

/// What to reshard, for which mesh, in which dialect.
#[derive(Clone, Debug)]
pub struct ReshardRequest {
    pub ckpt: PathBuf,
    pub mesh: Mesh,
    /// The dialect to write; `None`: the source's.
    pub target: Option<Dialect>,
    /// The source mesh, for a checkpoint without `args`.
    pub from_mesh: Option<Mesh>,
    pub rng: RngPolicy,
    pub vocab_size: Option<u64>,
    pub vocab_divisible_by: Option<u64>,
}

/// A reshard planned and checked whole, nothing written yet.
pub struct PlannedReshard {
    pub source: TrainingCheckpoint,
    pub plan: ReshardPlan,
    pub options: ReshardOptions,
    /// Where the source mesh came from: `--from-mesh`, `args`, or the chunk geometry.
    pub source_mesh_from: &'static str,
}

impl PlannedReshard {
    /// The bytes of the tensors it writes.
    pub fn total_bytes(&self) -> u64 {
        self.plan.tensors.iter().map(|t| t.out.nbytes()).sum()
    }

    /// How many of its tensors are optimizer state.
    pub fn optimizer_states(&self) -> usize {
        self.plan.tensors.iter().filter(|t| matches!(t.out.role, Role::OptimizerState { .. })).count()
    }

    /// The source mesh and where it came from, or that it is unknown.
    pub fn source_mesh_said(&self) -> String {
        self.options.source_mesh.map_or("unknown (no args; pass --from-mesh)".to_string(), |m| {
            format!("{m}, from {}", self.source_mesh_from)
        })
    }

    /// Writes it into `to` (`.metadata` last), counting bytes into `progress`.
    pub fn write(
        &self,
        to: &Path,
        threads: usize,
        overwrite: bool,
        progress: &Progress,
    ) -> Result<ReshardReport, OpsError> {
        progress.bytes_total.store(self.total_bytes(), Ordering::Relaxed);
        write_resharded(&self.source, &self.plan, to, threads.max(1), overwrite, progress)
            .map_err(|source| OpsError::Output { path: to.to_path_buf(), source })
    }
}

/// Reads `request.ckpt` and plans its reshard; the plan's notes (RNG states copied or dropped,
/// items carried without being understood) and the source's (what it leaves out) are in it.
pub fn plan_reshard_of(request: &ReshardRequest) -> Result<PlannedReshard, OpsError> {
    let ckpt = &request.ckpt;
    let dir = resolve_checkpoint_dir(ckpt).map_err(|source| OpsError::Checkpoint { path: ckpt.clone(), source })?;
    let source_dialect = if is_torch_dist(&dir) { Dialect::TorchDist } else { Dialect::FsdpDtensor };
    let dialect = request.target.unwrap_or(source_dialect);
    let training = |source| OpsError::Training { path: ckpt.clone(), source };
    let mut source = TrainingCheckpoint::open_for(ckpt, Some(request.mesh.etp)).map_err(training)?;
    if let Some(dialect) = fsdp2_dialect(&source) {
        return plan_fsdp2(ckpt, source, dialect, request.mesh, request.target, request.rng);
    }
    let given = ReshardHints {
        source_mesh: request.from_mesh,
        vocab_size: request.vocab_size,
        vocab_divisible_by: request.vocab_divisible_by,
    };
    let saved_mesh = source.args.as_ref().and_then(|a| a.mesh());
    let (inferred, source_mesh_from) = match (given.source_mesh, saved_mesh) {
        (Some(_), _) => (None, "--from-mesh"),
        (None, Some(_)) => (None, "args"),
        (None, None) => (inferred_mesh(&source), "chunk geometry; cp folded into dp"),
    };
    let fallback = ReshardHints { source_mesh: inferred, ..ReshardHints::default() };
    let mut options = reshard_options(&source, request.mesh, request.rng, given, fallback);
    options.dialect = dialect;
    if dialect == Dialect::TorchDist {
        source.split_fused(options.source_mesh.map(|m| m.etp)).map_err(training)?;
    }
    let plan = plan_reshard(&source.items, &options).map_err(|source| OpsError::Reshard {
        ckpt: ckpt.clone(),
        mesh: options.mesh.to_string(),
        source,
    })?;
    Ok(PlannedReshard { source, plan, options, source_mesh_from })
}

/// The FSDP2 framework whose checkpoint `source` is (torchtitan's, by its keys), if it is one.
pub fn fsdp2_dialect(source: &TrainingCheckpoint) -> Option<Dialect> {
    torchtitan_target(&source.checkpoint).map(Dialect::Torchtitan)
}

/// An FSDP2 framework's training checkpoint (torchtitan's `step-N/`) re-tiled over the data-parallel
/// degree of `mesh` as the framework places it (`reshard::fsdp2`); `target`, when given, must be
/// its own dialect.
pub fn plan_fsdp2(
    ckpt: &Path,
    source: TrainingCheckpoint,
    dialect: Dialect,
    mesh: Mesh,
    target: Option<Dialect>,
    rng: RngPolicy,
) -> Result<PlannedReshard, OpsError> {
    let refuse = |source: ReshardError| OpsError::Reshard { ckpt: ckpt.to_path_buf(), mesh: mesh.to_string(), source };
    let m = mesh;
    if (m.tp, m.cp, m.ep, m.etp) != (1, 1, 1, 1) {
        return Err(refuse(ReshardError::Mesh(format!(
            "a {} checkpoint is resharded over data parallelism (--dp) only; its tensor-, context- and \
             expert-parallel placements are not written yet",
            dialect.name()
        ))));
    }
    if let Some(target) = target.filter(|t| t.name() != dialect.name()) {
        return Err(refuse(ReshardError::Mesh(format!(
            "a {} checkpoint is not translated to {} yet",
            dialect.name(),
            target.name()
        ))));
    }
    let files = source.checkpoint.tensors.iter().flat_map(|t| t.chunks.iter().map(|c| &c.file));
    let files = files.chain(source.checkpoint.objects.iter().map(|o| &o.file));
    let source_ranks = files.collect::<BTreeSet<_>>().len() as u64;
    let options = Fsdp2Options { dialect, dp: m.dp, source_ranks };
    let plan = plan_fsdp2_reshard(&source.items, &options).map_err(refuse)?;
    let options = ReshardOptions {
        mesh: plan.mesh,
        source_mesh: Some(Mesh { dp: source_ranks, ..Mesh::new(1, 1, 1, 1) }),
        vocab_size: None,
        vocab_divisible_by: 1,
        num_experts: None,
        num_query_groups: None,
        rng,
        dialect,
    };
    Ok(PlannedReshard { source, plan, options, source_mesh_from: "its rank files" })
}
