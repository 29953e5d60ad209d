//! `reshard`: a training checkpoint saved on one mesh, planned and written for another. The
//! options a reshard takes from what it is told, the checkpoint's `args` and its chunk geometry
//! are merged here once, for the CLI, the pipeline's `checkpoint.reshard` step and Python.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use shardline_formats::checkpoint::resolve_checkpoint_dir;
use shardline_formats::execute::Progress;
use shardline_formats::training::automodel::{write_automodel, AutomodelPlans, AutomodelSave, RankFileCopies};
use shardline_formats::training::common_state::is_torch_dist;
use shardline_formats::training::{
    commit_resharded, rank_of_file, write_resharded, write_resharded_ranks, ReshardReport, TrainingCheckpoint,
};
use shardline_layout::dialect::Dialect;
use shardline_layout::reshard::{
    infer_mesh, plan_reshard, reshard_cost, ReshardCost, ReshardOptions, ReshardPlan, RngPolicy, TargetTensor,
};
use shardline_layout::{Mesh, Role};

use crate::fsdp2::OpenedCheckpoint;
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
        model_dtype: saved.params_dtype,
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
    /// A NeMo Automodel save: `source` and `plan` are its `model/`, this the rest of it.
    pub automodel: Option<AutomodelReshard>,
}

/// What an Automodel save adds to its `model/`'s plan: `optim/`, and its per-rank files.
pub struct AutomodelReshard {
    pub save: AutomodelSave,
    pub optim: Option<(TrainingCheckpoint, ReshardPlan)>,
    /// Which source rank's file each target rank takes, per state ([`AutomodelSave::rank_files`]).
    pub rank_files: Vec<RankFileCopies>,
}

impl PlannedReshard {
    fn plans(&self) -> impl Iterator<Item = &ReshardPlan> {
        let optim = self.automodel.as_ref().and_then(|a| a.optim.as_ref()).map(|(_, p)| p);
        std::iter::once(&self.plan).chain(optim)
    }

    /// The bytes of the tensors it writes.
    pub fn total_bytes(&self) -> u64 {
        self.plans().flat_map(|p| &p.tensors).map(|t| t.out.nbytes()).sum()
    }

    /// How many tensors it writes.
    pub fn tensor_count(&self) -> usize {
        self.plans().map(|p| p.tensors.len()).sum()
    }

    /// How many of its tensors are optimizer state.
    pub fn optimizer_states(&self) -> usize {
        let moment = |t: &&TargetTensor| match &t.out.role {
            Role::OptimizerState { state, .. } => *state != "step",
            Role::Param => false,
        };
        let optim_dir = self.automodel.as_ref().and_then(|a| a.optim.as_ref()).map_or(0, |(_, p)| p.tensors.len());
        self.plan.tensors.iter().filter(moment).count() + optim_dir
    }

    /// What each target rank file costs (see `reshard::cost`): summed over `model/` and `optim/`
    /// for a NeMo Automodel save, whose rank files hold both.
    pub fn cost(&self) -> ReshardCost {
        let optim = self.automodel.as_ref().and_then(|a| a.optim.as_ref());
        let parts = std::iter::once((&self.source, &self.plan)).chain(optim.map(|(s, p)| (s, p)));
        let mut total = ReshardCost::default();
        for (source, plan) in parts {
            // The file of every stored chunk, numbered by name.
            let mut numbers: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
            let files: Vec<Vec<u64>> = (0..source.items.len())
                .map(|i| {
                    let chunks = source.chunks_of(i);
                    chunks
                        .iter()
                        .map(|c| {
                            let next = numbers.len() as u64;
                            *numbers.entry(&*c.file).or_insert(next)
                        })
                        .collect()
                })
                .collect();
            let cost = reshard_cost(&source.items, &files, plan);
            total.source_bytes += cost.source_bytes;
            total.source_chunks += cost.source_chunks;
            total.ranks.resize(total.ranks.len().max(cost.ranks.len()), Default::default());
            for (t, c) in total.ranks.iter_mut().zip(cost.ranks) {
                t.chunks += c.chunks;
                t.bytes_written += c.bytes_written;
                t.bytes_read += c.bytes_read;
                t.reads += c.reads;
                // `model/` and `optim/` are files of their own.
                t.source_files += c.source_files;
            }
        }
        total
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
        let written = match &self.automodel {
            Some(a) => {
                let plans = AutomodelPlans {
                    model: (&self.source, &self.plan),
                    optim: a.optim.as_ref().map(|(s, p)| (s, p)),
                    rank_files: &a.rank_files,
                    config_sizes: &[("dp_size", self.plan.mesh.dp), ("ep_size", self.plan.mesh.ep)],
                };
                write_automodel(&a.save, &plans, to, threads.max(1), overwrite, progress)
            }
            None => write_resharded(&self.source, &self.plan, to, threads.max(1), overwrite, progress),
        };
        written.map_err(|source| OpsError::Output { path: to.to_path_buf(), source })
    }
    /// Whether it can be written by several tasks ([`Self::write_ranks`], then [`Self::commit`]):
    /// a Megatron (`fsdp_dtensor`, `torch_dist`) or torchtitan target. A NeMo Automodel save's
    /// `model/`, `optim/` and per-rank files are written by one task.
    pub fn splits_by_rank(&self) -> bool {
        self.automodel.is_none()
    }

    /// Writes the target rank files `ranks` into `to`, part of a reshard split over tasks.
    pub fn write_ranks(
        &self,
        to: &Path,
        ranks: std::ops::Range<u64>,
        threads: usize,
        progress: &Progress,
    ) -> Result<ReshardReport, OpsError> {
        let output = |source| OpsError::Output { path: to.to_path_buf(), source };
        if !self.splits_by_rank() {
            return Err(OpsError::Refused("a NeMo Automodel save is resharded by one task".into()));
        }
        let cost = self.cost();
        let planned: u64 = ranks.clone().filter_map(|r| cost.ranks.get(r as usize)).map(|c| c.bytes_written).sum();
        progress.bytes_total.store(planned, Ordering::Relaxed);
        write_resharded_ranks(&self.source, &self.plan, to, ranks, threads.max(1), progress).map_err(output)
    }

    /// Finishes a reshard whose rank files [`Self::write_ranks`] wrote into `to`: checks them
    /// all, then writes `.metadata` (and a save directory's files) last.
    pub fn commit(&self, to: &Path) -> Result<ReshardReport, OpsError> {
        if !self.splits_by_rank() {
            return Err(OpsError::Refused("a NeMo Automodel save is resharded by one task".into()));
        }
        commit_resharded(&self.source, &self.plan, to)
            .map_err(|source| OpsError::Output { path: to.to_path_buf(), source })
    }
}

/// Reads `request.ckpt` and plans its reshard; the plan's notes (RNG states copied or dropped,
/// items carried without being understood) and the source's (what it leaves out) are in it.
pub fn plan_reshard_of(request: &ReshardRequest) -> Result<PlannedReshard, OpsError> {
    let ckpt = &request.ckpt;
    let training = |source| OpsError::Training { path: ckpt.clone(), source };
    let opened = OpenedCheckpoint::open(ckpt, request.mesh.etp)?;
    let mut source = match opened.plan_fsdp2(ckpt, request.mesh, request.target, request.rng)? {
        Ok(planned) => return Ok(planned),
        Err(megatron) => megatron,
    };
    let dir = resolve_checkpoint_dir(ckpt).map_err(|source| OpsError::Checkpoint { path: ckpt.clone(), source })?;
    let source_dialect = if is_torch_dist(&dir) { Dialect::TorchDist } else { Dialect::FsdpDtensor };
    let dialect = request.target.unwrap_or(source_dialect);
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
    Ok(PlannedReshard { source, plan, options, source_mesh_from, automodel: None })
}
