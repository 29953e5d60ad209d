//! `reshard` of an FSDP2 framework's training checkpoint: torchtitan's `step-N/`, or NeMo
//! Automodel's `epoch_E_step_S/` (its `model/` and `optim/` each re-tiled, its per-rank files
//! given to the new world), over the target's data-parallel degree (`reshard::fsdp2`).

use std::collections::BTreeSet;
use std::path::Path;

use shardline_formats::checkpoint::torchtitan_target;
use shardline_formats::training::automodel::AutomodelSave;
use shardline_formats::training::TrainingCheckpoint;
use shardline_layout::dialect::Dialect;
use shardline_layout::reshard::{
    mismatched_states, plan_fsdp2_reshard, Fsdp2Options, ReshardError, ReshardOptions, ReshardPlan, RngPolicy,
};
use shardline_layout::Mesh;

use crate::reshard::{AutomodelReshard, PlannedReshard};
use crate::OpsError;

/// A reshard's source, opened: which kind of checkpoint it is decides who plans it.
pub enum OpenedCheckpoint {
    /// A NeMo Automodel save `epoch_E_step_S/`.
    Automodel(AutomodelSave),
    /// A torchtitan checkpoint (known by its keys).
    Torchtitan(TrainingCheckpoint, Dialect),
    /// A Megatron training checkpoint, `fsdp_dtensor` or `torch_dist` (read for expert-TP size
    /// `etp`).
    Megatron(TrainingCheckpoint),
}

impl OpenedCheckpoint {
    /// Opens `ckpt`, for a target of expert-TP size `etp`.
    pub fn open(ckpt: &Path, etp: u64) -> Result<OpenedCheckpoint, OpsError> {
        let training = |source| OpsError::Training { path: ckpt.to_path_buf(), source };
        if let Some(save) = AutomodelSave::open(ckpt).map_err(training)? {
            return Ok(OpenedCheckpoint::Automodel(save));
        }
        let source = TrainingCheckpoint::open_for(ckpt, Some(etp)).map_err(training)?;
        Ok(match torchtitan_target(&source.checkpoint) {
            Some(target) => OpenedCheckpoint::Torchtitan(source, Dialect::Torchtitan(target)),
            None => OpenedCheckpoint::Megatron(source),
        })
    }

    /// The plan of an FSDP2 framework's source, or the Megatron checkpoint for the caller to plan.
    pub fn plan_fsdp2(
        self,
        ckpt: &Path,
        mesh: Mesh,
        target: Option<Dialect>,
        rng: RngPolicy,
    ) -> Result<Result<PlannedReshard, TrainingCheckpoint>, OpsError> {
        match self {
            OpenedCheckpoint::Automodel(save) => plan_automodel(ckpt, save, mesh, target, rng).map(Ok),
            OpenedCheckpoint::Torchtitan(source, dialect) => {
                plan_torchtitan(ckpt, source, dialect, mesh, target, rng).map(Ok)
            }
            OpenedCheckpoint::Megatron(source) => Ok(Err(source)),
        }
    }
}

/// What an FSDP2 reshard can be asked for: another data-parallel degree, in the source's own
/// dialect.
fn check_request(dialect: Dialect, mesh: Mesh, target: Option<Dialect>) -> Result<(), ReshardError> {
    let what = match dialect {
        Dialect::Automodel => "a NeMo Automodel save",
        _ => "a torchtitan checkpoint",
    };
    if let Dialect::Torchtitan(_) = dialect {
        // torchtitan has no expert tensor parallelism (the CLI's default etp is tp).
        if mesh.cp != 1 || (mesh.etp != 1 && mesh.etp != mesh.tp) {
            return Err(ReshardError::Mesh(format!(
                "{what} is resharded over data, tensor and expert parallelism (--dp, --tp, --ep): context \
                 parallelism keeps no parameter shard, and torchtitan has no expert tensor parallelism (leave --etp out)"
            )));
        }
    } else if (mesh.tp, mesh.cp, mesh.etp) != (1, 1, 1) {
        return Err(ReshardError::Mesh(format!(
            "{what} is resharded over data and expert parallelism (--dp, --ep) only; its tensor- and \
             context-parallel placements are not written yet"
        )));
    }
    match target.filter(|t| t.name() != dialect.name()) {
        Some(target) => Err(ReshardError::Mesh(format!("{what} is not translated to {} yet", target.name()))),
        None => Ok(()),
    }
}

/// The plan of one DCP (or HF-storage) directory of an FSDP2 checkpoint, and its source's rank
/// file count.
fn plan_dir(source: &TrainingCheckpoint, dialect: Dialect, mesh: Mesh) -> Result<(ReshardPlan, u64), ReshardError> {
    let files = source.checkpoint.tensors.iter().flat_map(|t| t.chunks.iter().map(|c| &c.file));
    let files = files.chain(source.checkpoint.objects.iter().map(|o| &o.file));
    let source_ranks = files.collect::<BTreeSet<_>>().len() as u64;
    let options = Fsdp2Options { dialect, dp: mesh.dp, tp: mesh.tp, ep: mesh.ep, source_ranks };
    let plan = plan_fsdp2_reshard(&source.items, &options)?;
    Ok((plan, source_ranks))
}

fn options(dialect: Dialect, plan: &ReshardPlan, source_ranks: u64, rng: RngPolicy) -> ReshardOptions {
    ReshardOptions {
        mesh: plan.mesh,
        source_mesh: Some(Mesh { dp: source_ranks, ..Mesh::new(1, 1, 1, 1) }),
        vocab_size: None,
        vocab_divisible_by: 1,
        num_experts: None,
        num_query_groups: None,
        rng,
        dialect,
        model_dtype: None,
    }
}

/// A torchtitan training checkpoint re-tiled over the data-parallel degree of `mesh` as torchtitan
/// places it; `target`, when given, must be its own dialect.
fn plan_torchtitan(
    ckpt: &Path,
    source: TrainingCheckpoint,
    dialect: Dialect,
    mesh: Mesh,
    target: Option<Dialect>,
    rng: RngPolicy,
) -> Result<PlannedReshard, OpsError> {
    let refuse = |source: ReshardError| OpsError::Reshard { ckpt: ckpt.to_path_buf(), mesh: mesh.to_string(), source };
    check_request(dialect, mesh, target).map_err(refuse)?;
    let (plan, source_ranks) = plan_dir(&source, dialect, mesh).map_err(refuse)?;
    let options = options(dialect, &plan, source_ranks, rng);
    Ok(PlannedReshard { source, plan, options, source_mesh_from: "its rank files", automodel: None })
}

/// A NeMo Automodel save re-tiled over the data-parallel degree of `mesh`: `model/` and `optim/`
/// keep each tensor's placement, every per-rank state file is given to each new rank (its own, or
/// the lowest rank's).
fn plan_automodel(
    ckpt: &Path,
    save: AutomodelSave,
    mesh: Mesh,
    target: Option<Dialect>,
    rng: RngPolicy,
) -> Result<PlannedReshard, OpsError> {
    let dialect = Dialect::Automodel;
    let refuse = |source: ReshardError| OpsError::Reshard { ckpt: ckpt.to_path_buf(), mesh: mesh.to_string(), source };
    let training = |source| OpsError::Training { path: ckpt.to_path_buf(), source };
    check_request(dialect, mesh, target).map_err(refuse)?;
    if rng == RngPolicy::Drop {
        return Err(refuse(ReshardError::Mesh(
            "--rng drop does not apply to a NeMo Automodel save: Automodel loads `rng/` on every rank and has no \
             option to skip it; each new rank gets a rank's state instead"
                .into(),
        )));
    }
    let model_dir = save.dir.join("model");
    let model = match save.model_format {
        shardline_formats::checkpoint::CheckpointFormat::Dcp => TrainingCheckpoint::open(&model_dir),
        shardline_formats::checkpoint::CheckpointFormat::DcpSafetensors => {
            TrainingCheckpoint::open_hf_storage(&model_dir)
        }
    }
    .map_err(training)?;
    let optim = match save.has_optim {
        true => Some(TrainingCheckpoint::open(&save.dir.join("optim")).map_err(training)?),
        false => None,
    };
    let (mut plan, source_ranks) = plan_dir(&model, dialect, mesh).map_err(refuse)?;
    let optim = match optim {
        Some(o) => {
            let mismatched = mismatched_states(&model.items, &o.items);
            if !mismatched.is_empty() {
                return Err(refuse(ReshardError::Many(mismatched)));
            }
            let (p, _) = plan_dir(&o, dialect, mesh).map_err(refuse)?;
            plan.notes.extend(p.notes.iter().cloned());
            Some((o, p))
        }
        None => None,
    };
    let (rank_files, notes) = save.rank_files(plan.mesh.world(), mesh.dp);
    plan.notes.extend(notes);
    let options = options(dialect, &plan, source_ranks, rng);
    Ok(PlannedReshard {
        source: model,
        plan,
        options,
        source_mesh_from: "its rank files",
        automodel: Some(AutomodelReshard { save, optim, rank_files }),
    })
}
