//! `convert`: an HF release into a checkpoint for a mesh, in one of the dialects; and the plan it
//! would write (`--dry-run`, `shardline.plan`).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use shardline_formats::checkpoint::TORCHTITAN_SEED_DIR;
use shardline_formats::execute::{
    write_checkpoint_from, ExecuteOptions, OutputFormat, Progress, SourceMap, WriteReport,
};
use shardline_formats::safetensors::Release;
use shardline_formats::training::save_dir::{self, SeedArgs};
use shardline_layout::{
    build_plan, validate_plan, Dialect, Mesh, ModelConfig, Plan, PlanOptions, PlanTable, SourceTensor,
};

use crate::OpsError;

/// What to convert, to where, and how. [`ConvertRequest::new`] gives the CLI's defaults.
#[derive(Clone, Debug)]
pub struct ConvertRequest {
    /// The HF release directory.
    pub from: PathBuf,
    /// The checkpoint directory to write (torch_dist: the save directory; torchtitan: the
    /// folder whose `step-0/` is written).
    pub to: PathBuf,
    pub mesh: Mesh,
    pub dialect: Dialect,
    pub format: OutputFormat,
    /// Prefix of every model key; `None`: the dialect's.
    pub prefix: Option<String>,
    /// Pad the vocab to a multiple of this times tp.
    pub vocab_divisible_by: u64,
    /// Also write zero-filled fp32 Adam states sharded like their parameters.
    pub optimizer_state: bool,
    /// Replace a checkpoint already at `to`.
    pub overwrite: bool,
    pub threads: usize,
    pub zip_crc32: bool,
}

impl ConvertRequest {
    pub fn new(from: PathBuf, to: PathBuf, mesh: Mesh) -> ConvertRequest {
        ConvertRequest {
            from,
            to,
            mesh,
            dialect: Dialect::FsdpDtensor,
            format: OutputFormat::Dcp,
            prefix: None,
            vocab_divisible_by: 128,
            optimizer_state: false,
            overwrite: false,
            threads: ExecuteOptions::default().threads,
            zip_crc32: false,
        }
    }

    /// The planner's options, once the combination is known to mean something.
    pub fn plan_options(&self) -> Result<PlanOptions, OpsError> {
        self.refusals()?;
        Ok(PlanOptions {
            prefix: self.prefix.clone().unwrap_or_else(|| self.dialect.default_prefix().to_string()),
            dialect: self.dialect,
            vocab_divisible_by: self.vocab_divisible_by,
            optimizer_state: self.optimizer_state,
            ..PlanOptions::default()
        })
    }

    /// The options a dialect gives no meaning to, refused with what to do instead.
    fn refusals(&self) -> Result<(), OpsError> {
        let refuse = |why: &str| Err(OpsError::Refused(why.to_string()));
        match self.dialect {
            Dialect::Torchtitan(_) => {
                if self.format != OutputFormat::Dcp {
                    return refuse("--target torchtitan is a DCP checkpoint; --format dcp-safetensors does not apply");
                }
                if self.optimizer_state {
                    return refuse(
                        "--optimizer-state does not apply to --target torchtitan: torchtitan loads `step-0` model-only, \
                         and builds its optimizer fresh",
                    );
                }
                if self.prefix.is_some() {
                    return refuse(
                        "--prefix does not apply to --target torchtitan: its model keys sit at the top level",
                    );
                }
            }
            Dialect::TorchDist => {
                if self.format != OutputFormat::Dcp {
                    return refuse("--target torch_dist is a DCP checkpoint; --format dcp-safetensors does not apply");
                }
                if self.optimizer_state {
                    return refuse(
                        "--optimizer-state does not apply to --target torch_dist: Megatron-LM loads a seed (iteration 0) \
                         only as `release`, and never reads optimizer state from a release checkpoint, so zero moments \
                         and fp32 masters would never be read; the fresh optimizer it builds on load holds exactly \
                         those. Convert without it, or use `reshard --target torch_dist` on a training checkpoint, \
                         which writes its state",
                    );
                }
            }
            Dialect::Automodel => {
                return refuse(
                    "there is no NeMo Automodel checkpoint to convert a release to: Automodel reads HF releases \
                     directly (point its model at the release); Shardline reshards and exports its training \
                     checkpoints",
                )
            }
            Dialect::FsdpDtensor => {}
        }
        Ok(())
    }
}

/// What a conversion wrote.
#[derive(Clone, Debug)]
pub struct ConvertReport {
    pub model_type: String,
    pub mesh: Mesh,
    pub world: u64,
    /// The directory holding the DCP files (for torch_dist `release/`, for torchtitan `step-0/`).
    pub out: PathBuf,
    pub written: WriteReport,
    pub source_bytes: u64,
    /// Release tensors left out by design (see `shardline_layout::arch::why_not_converted`).
    pub unconverted: Vec<String>,
    pub seconds: f64,
}

fn open_release(from: &Path) -> Result<Release, OpsError> {
    Release::open(from).map_err(|source| OpsError::Release { path: from.to_path_buf(), source })
}

pub(crate) fn read_config(release: &Release, from: &Path) -> Result<ModelConfig, OpsError> {
    ModelConfig::from_json(release.config_json())
        .map_err(|source| OpsError::Config { path: from.join("config.json"), source })
}

/// Plans the release tensors `sources` and checks the plan against the invariants.
pub(crate) fn plan_sources(
    config: &ModelConfig,
    sources: Vec<SourceTensor>,
    mesh: Mesh,
    options: &PlanOptions,
) -> Result<Plan, OpsError> {
    let plan = build_plan(config, sources, mesh, options).map_err(|errors| OpsError::Plan {
        model_type: config.model_type.clone(),
        mesh: mesh.to_string(),
        problems: errors.iter().map(|e| e.to_string()).collect(),
    })?;
    let violations = validate_plan(&plan, config.num_experts, mesh.ep);
    if !violations.is_empty() {
        return Err(OpsError::Invariants {
            count: violations.len(),
            shown: violations.iter().take(20).map(|v| v.to_string()).collect(),
        });
    }
    Ok(plan)
}

/// Opens a release and plans it for `mesh`; every planning error is reported at once.
pub fn plan_release(from: &Path, mesh: Mesh, options: &PlanOptions) -> Result<(Release, Plan), OpsError> {
    let release = open_release(from)?;
    let config = read_config(&release, from)?;
    let sources = release
        .tensors()
        .map(|t| SourceTensor { name: t.info.name.clone(), dtype: t.info.dtype, shape: t.info.shape.clone() })
        .collect();
    let plan = plan_sources(&config, sources, mesh, options)?;
    Ok((release, plan))
}

/// Converts the release `request.from` into `request.to`, counting bytes into `progress`.
/// `return_freed_memory` runs where the planning's memory has just been dropped (the CLI gives
/// glibc's heap back to the system there; other callers pass a no-op).
pub fn convert(
    request: &ConvertRequest,
    progress: &Progress,
    return_freed_memory: &dyn Fn(),
) -> Result<ConvertReport, OpsError> {
    let options = request.plan_options()?;
    let (mesh, dialect, root) = (request.mesh, request.dialect, request.to.as_path());
    let release = open_release(&request.from)?;
    let config = read_config(&release, &request.from)?;
    let source_bytes = release.total_bytes();
    let seed_args = (dialect == Dialect::TorchDist)
        .then(|| SeedArgs::for_model(&config, release.config_json(), mesh, options.vocab_divisible_by));
    // The release's tensor descriptions move into the plan's sources: a release is described
    // once while it is planned, and not at all while it is copied.
    let (sources, locations) = release.into_sources();
    let mut plan = plan_sources(&config, sources, mesh, &options)?;
    progress.bytes_total.store(plan.bytes_per_rank().iter().sum(), Ordering::Relaxed);
    // torch_dist: a save directory, the checkpoint in `release/`; torchtitan: `step-0/`, which
    // it loads model-only.
    let out = match dialect {
        Dialect::TorchDist => save_dir::seed_dir(root),
        Dialect::Torchtitan(_) => root.join(TORCHTITAN_SEED_DIR),
        Dialect::FsdpDtensor | Dialect::Automodel => root.to_path_buf(),
    };
    if seed_args.is_some() {
        if !request.overwrite && root.join(save_dir::TRACKER).exists() {
            return Err(OpsError::Refused(format!(
                "{} already holds a Megatron save directory (its tracker {}); pass --overwrite to replace it",
                root.display(),
                save_dir::TRACKER
            )));
        }
        // Never point at a checkpoint while it is rewritten.
        save_dir::withdraw_tracker(root).map_err(|source| OpsError::Replace { path: root.to_path_buf(), source })?;
    }
    let exec = ExecuteOptions {
        format: request.format,
        threads: request.threads,
        overwrite: request.overwrite,
        zip_crc32: request.zip_crc32,
        ..ExecuteOptions::default()
    };
    let started = Instant::now();
    let write_error = |source| OpsError::Write { path: out.clone(), source };
    let sources = SourceMap::open(&plan, locations).map_err(write_error)?;
    // From here on the writers read through `sources` and a flat table of the plan. The plan's
    // descriptions of the sources go first, so that the table is built in the room they and
    // planning leave; then the plan goes, and the copy runs in the memory of the table and the
    // I/O buffers alone.
    drop(std::mem::take(&mut plan.sources));
    return_freed_memory();
    let table = PlanTable::new(&plan);
    let (model_type, unconverted) = (std::mem::take(&mut plan.model_type), std::mem::take(&mut plan.unconverted));
    drop(plan);
    return_freed_memory();
    let written = write_checkpoint_from(&table, &sources, &out, &exec, progress).map_err(write_error)?;
    if let Some(seed) = &seed_args {
        save_dir::finish_seed_save(root, seed)
            .map_err(|source| OpsError::SaveDir { path: root.to_path_buf(), source })?;
    }
    Ok(ConvertReport {
        model_type,
        mesh,
        world: table.world(),
        out,
        written,
        source_bytes,
        unconverted,
        seconds: started.elapsed().as_secs_f64(),
    })
}
