//! `export`: a checkpoint's model weights written back as the HF release they came from — for
//! the CLI, the pipeline's `checkpoint.export` step and Python alike.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use shardline_formats::checkpoint::{
    automodel_model_dir, open_checkpoint_keys, resolve_checkpoint_dir, torchtitan_target, torchtitan_target_of,
    Checkpoint,
};
use shardline_formats::execute::Progress;
use shardline_formats::safetensors::Release;
use shardline_formats::training::common_state::is_torch_dist;
use shardline_formats::training::{
    commit_export, summarize_training, write_export, write_export_part, ExportOptions, ExportReport, TrainingCheckpoint,
};
use shardline_layout::dialect::Dialect;
use shardline_layout::export::{plan_export, plan_export_as_named, ExportTensor};
use shardline_layout::{DType, Mesh, ModelConfig, PlanOptions, SourceTensor};

use crate::convert::{plan_sources, read_config};
use crate::OpsError;

/// What to export, as what, to where.
#[derive(Clone, Debug)]
pub struct ExportRequest {
    /// The checkpoint: a DCP directory, a Megatron-LM save directory, a torchtitan folder, a
    /// NeMo Automodel `epoch_E_step_S/`.
    pub ckpt: PathBuf,
    /// The HF directory to write.
    pub to: PathBuf,
    /// The release whose names, dtypes, shapes and files to reproduce; `None` for a NeMo
    /// Automodel save: its `model/.hf_metadata/` (see [`automodel_release`]).
    pub like: Option<PathBuf>,
    /// Prefix of the model keys of an `fsdp_dtensor` checkpoint.
    pub prefix: String,
    /// The expert-TP size it was saved with; `None`: its `args`', else 1.
    pub etp: Option<u64>,
    pub max_file_bytes: u64,
    pub overwrite: bool,
    pub threads: usize,
}

/// What an export wrote.
#[derive(Clone, Debug)]
pub struct ExportDone {
    pub written: ExportReport,
    /// Where the release's other files (and, without `like`, its description) came from.
    pub like: PathBuf,
    pub etp: u64,
    pub seconds: f64,
}

/// What NeMo Automodel keeps of the release it trained from, in `model/.hf_metadata/`: the
/// release's `config.json`, tokenizer files and generation config, each tensor's file number
/// (`fqn_to_file_index_mapping.json`) and original dtype (`fqn_to_dtype_mapping.json`, as
/// safetensors spells dtypes). With the checkpoint's own names and global shapes, that is the
/// release's description, so such a save exports without the release at hand.
pub struct AutomodelRelease {
    pub dir: PathBuf,
    pub file_numbers: HashMap<String, u64>,
    pub dtypes: HashMap<String, DType>,
}

/// The `.hf_metadata/` of the NeMo Automodel save `ckpt`, when it has one with the file numbering.
pub fn automodel_release(ckpt: &Path) -> Result<Option<AutomodelRelease>, OpsError> {
    let model =
        automodel_model_dir(ckpt).map_err(|source| OpsError::Checkpoint { path: ckpt.to_path_buf(), source })?;
    let Some(dir) = model.map(|m| m.join(".hf_metadata")) else { return Ok(None) };
    let numbers = dir.join("fqn_to_file_index_mapping.json");
    if !numbers.is_file() {
        return Ok(None);
    }
    let read = |path: &Path| -> Result<Option<String>, OpsError> {
        match std::fs::read_to_string(path) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(OpsError::Refused(format!("{}: {e}", path.display()))),
        }
    };
    let bad = |path: &Path, e: serde_json::Error| OpsError::Refused(format!("{}: {e}", path.display()));
    let file_numbers: HashMap<String, u64> = match read(&numbers)? {
        Some(text) => serde_json::from_str(&text).map_err(|e| bad(&numbers, e))?,
        None => return Ok(None),
    };
    let dtype_path = dir.join("fqn_to_dtype_mapping.json");
    let names: HashMap<String, String> = match read(&dtype_path)? {
        Some(text) => serde_json::from_str(&text).map_err(|e| bad(&dtype_path, e))?,
        None => HashMap::new(),
    };
    let mut dtypes = HashMap::new();
    for (key, name) in names {
        let dtype = DType::from_safetensors_name(&name).ok_or_else(|| {
            OpsError::Refused(format!(
                "{}: `{key}` has the dtype `{name}`, which is not a safetensors dtype",
                dtype_path.display()
            ))
        })?;
        dtypes.insert(key, dtype);
    }
    Ok(Some(AutomodelRelease { dir, file_numbers, dtypes }))
}

/// The export plan of an Automodel save as the release its `.hf_metadata/` describes: every
/// model tensor whole under its own name, in its original dtype, in the release's file order.
fn automodel_export(checkpoint: &Checkpoint, release: &AutomodelRelease) -> Result<Vec<ExportTensor>, OpsError> {
    let mut sources: Vec<SourceTensor> = checkpoint
        .tensors
        .iter()
        .map(|t| SourceTensor {
            name: t.key.clone(),
            dtype: release.dtypes.get(&t.key).copied().unwrap_or(t.dtype),
            shape: t.shape.clone(),
        })
        .collect();
    sources.sort_by_key(|s| (release.file_numbers.get(&s.name).copied().unwrap_or(0), s.name.clone()));
    let shapes: BTreeMap<String, Vec<u64>> =
        checkpoint.tensors.iter().map(|t| (t.key.clone(), t.shape.clone())).collect();
    plan_export_as_named(&sources, &shapes).map_err(|errors| OpsError::Export {
        ckpt: checkpoint.dir.clone(),
        like: release.dir.clone(),
        problems: errors.iter().map(|e| e.to_string()).collect(),
    })
}

/// The expert-TP size a checkpoint was saved with, as its `args` say.
pub fn saved_etp(dir: &Path) -> Option<u64> {
    // From the bytes items alone: an export's copy of the checkpoint may hold only its model.
    summarize_training(dir).ok().flatten().and_then(|s| s.mesh).map(|m| m.etp)
}

/// A checkpoint's model keys opened for export (never the optimizer's moments), the prefix they
/// carry, and whether it is a `torch_dist` checkpoint. A torch_dist checkpoint's keys are read
/// under the `fsdp_dtensor` names they stand for (layers and experts unstacked, `[gate; up]`
/// split), in place; NeMo Automodel's `model/` holds the release's own names; a torchtitan
/// checkpoint's model keys sit at the top level beside its optimizer, scheduler, dataloader and
/// train state.
pub fn open_model(ckpt: &Path, prefix: &str) -> Result<(Checkpoint, String, bool), OpsError> {
    let checkpoint_error = |source| OpsError::Checkpoint { path: ckpt.to_path_buf(), source };
    let dir = resolve_checkpoint_dir(ckpt).map_err(checkpoint_error)?;
    if is_torch_dist(&dir) {
        let c = TrainingCheckpoint::open_torch_dist_model(ckpt)
            .map_err(|source| OpsError::Training { path: ckpt.to_path_buf(), source })?;
        return Ok((c, "model.module.".to_string(), true));
    }
    if automodel_model_dir(ckpt).map_err(checkpoint_error)?.is_some() {
        return Ok((open_checkpoint_keys(ckpt, |_| true).map_err(checkpoint_error)?, String::new(), false));
    }
    if torchtitan_target_of(&dir).map_err(checkpoint_error)?.is_some() {
        let model =
            |k: &str| !["optimizer.", "lr_scheduler.", "dataloader.", "train_state."].iter().any(|p| k.starts_with(p));
        return Ok((open_checkpoint_keys(ckpt, model).map_err(checkpoint_error)?, String::new(), false));
    }
    let c = open_checkpoint_keys(ckpt, |k| k.starts_with(prefix)).map_err(checkpoint_error)?;
    Ok((c, prefix.to_string(), false))
}

/// The export plan of `checkpoint` as the release `like`: the release's conversion plan for the
/// mesh `{tp 1, dp etp, etp}` (global tensors depend on no mesh but for what is fused per
/// expert-TP rank), inverted against the checkpoint's shapes.
pub fn export_tensors(
    checkpoint: &Checkpoint,
    like: &Path,
    etp: u64,
    prefix: &str,
) -> Result<Vec<ExportTensor>, OpsError> {
    let release = Release::open(like).map_err(|source| OpsError::Release { path: like.to_path_buf(), source })?;
    let config: ModelConfig = read_config(&release, like)?;
    let sources: Vec<SourceTensor> = release
        .tensors()
        .map(|t| SourceTensor { name: t.info.name.clone(), dtype: t.info.dtype, shape: t.info.shape.clone() })
        .collect();
    let shapes: BTreeMap<String, Vec<u64>> =
        checkpoint.tensors.iter().map(|t| (t.key.clone(), t.shape.clone())).collect();
    let cannot = |errors: Vec<String>| OpsError::Export {
        ckpt: checkpoint.dir.clone(),
        like: like.to_path_buf(),
        problems: errors,
    };
    let torchtitan = torchtitan_target(checkpoint);
    // A checkpoint under the release's own names (NeMo Automodel's `model/`): each tensor whole.
    // (`lm_head.weight` alone says nothing: torchtitan spells it so too.)
    if torchtitan.is_none() && sources.iter().any(|s| s.name != "lm_head.weight" && shapes.contains_key(&s.name)) {
        return plan_export_as_named(&sources, &shapes)
            .map_err(|errors| cannot(errors.iter().map(|e| e.to_string()).collect()));
    }
    let mesh = Mesh { tp: 1, cp: 1, dp: etp, ep: 1, etp };
    // A torchtitan checkpoint is read back through the plan of its own version's names.
    let (dialect, prefix) = match torchtitan {
        Some(target) => (Dialect::Torchtitan(target), ""),
        None => (Dialect::FsdpDtensor, prefix),
    };
    let options = PlanOptions { prefix: prefix.to_string(), vocab_divisible_by: 1, dialect, ..PlanOptions::default() };
    let forward = plan_sources(&config, sources, mesh, &options)?;
    plan_export(&forward, &shapes).map_err(|errors| cannot(errors.iter().map(|e| e.to_string()).collect()))
}

/// An export planned and checked, nothing written yet: the checkpoint's model, the release
/// tensors it gives back, and how they are cut into files.
pub struct PlannedExport {
    pub checkpoint: Checkpoint,
    pub tensors: Vec<ExportTensor>,
    /// Where the release's other files (and, without `like`, its description) come from.
    pub like: PathBuf,
    pub etp: u64,
    pub options: ExportOptions,
    pub to: PathBuf,
}

impl PlannedExport {
    /// The bytes of the release tensors it writes.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.shape.iter().product::<u64>() * t.dtype.size() as u64).sum()
    }

    /// Writes it whole into `to`, counting bytes into `progress`.
    pub fn write(&self, progress: &Progress) -> Result<ExportReport, OpsError> {
        progress.bytes_total.store(self.total_bytes(), Ordering::Relaxed);
        write_export(&self.checkpoint, &self.tensors, &self.like, &self.to, &self.options, progress)
            .map_err(|source| OpsError::Output { path: self.to.clone(), source })
    }

    /// Writes part `part` of `parts` of its weight files into the staging directory of `to`
    /// (see `write_export_part`); returns their names.
    pub fn write_part(&self, (part, parts): (u64, u64), progress: &Progress) -> Result<Vec<String>, OpsError> {
        if part >= parts {
            return Err(OpsError::Refused(format!("part {part} is not one of {parts}")));
        }
        write_export_part(&self.checkpoint, &self.tensors, &self.to, &self.options, (part, parts), progress)
            .map_err(|source| OpsError::Output { path: self.to.clone(), source })
    }

    /// Finishes an export written in parts: every weight file checked, then the index, the
    /// release's other files and the rename into place.
    pub fn commit(&self) -> Result<ExportReport, OpsError> {
        commit_export(&self.tensors, &self.like, &self.to, &self.options)
            .map_err(|source| OpsError::Output { path: self.to.clone(), source })
    }
}

/// Plans the export of `request.ckpt` as `request.like` (or, for an Automodel save, the release
/// its `.hf_metadata/` describes) into `request.to`.
pub fn plan_export_of(request: &ExportRequest) -> Result<PlannedExport, OpsError> {
    let (checkpoint, prefix, torch_dist) = open_model(&request.ckpt, &request.prefix)?;
    // A torch_dist checkpoint's fused parameters are read for expert-TP size 1 (`[gate; up]`).
    let etp = if torch_dist { 1 } else { request.etp.or_else(|| saved_etp(&request.ckpt)).unwrap_or(1) };
    let (tensors, like, file_numbers) = match &request.like {
        Some(like) => (export_tensors(&checkpoint, like, etp, &prefix)?, like.clone(), None),
        None => match automodel_release(&request.ckpt)? {
            Some(release) => (automodel_export(&checkpoint, &release)?, release.dir, Some(release.file_numbers)),
            None => {
                return Err(OpsError::Refused(format!(
                    "{} names no release: pass --like HF_RELEASE (its config.json decides the names); a NeMo \
                     Automodel save describes its own in model/.hf_metadata/",
                    request.ckpt.display()
                )))
            }
        },
    };
    let options = ExportOptions {
        max_file_bytes: request.max_file_bytes,
        file_numbers,
        threads: request.threads.max(1),
        overwrite: request.overwrite,
    };
    Ok(PlannedExport { checkpoint, tensors, like, etp, options, to: request.to.clone() })
}

/// Exports `request.ckpt` as `request.like` (or, for an Automodel save, the release its
/// `.hf_metadata/` describes) into `request.to`, counting bytes into `progress`.
pub fn export(request: &ExportRequest, progress: &Progress) -> Result<ExportDone, OpsError> {
    let started = Instant::now();
    let planned = plan_export_of(request)?;
    let written = planned.write(progress)?;
    Ok(ExportDone { written, like: planned.like, etp: planned.etp, seconds: started.elapsed().as_secs_f64() })
}
