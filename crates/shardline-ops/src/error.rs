//! Why an operation failed, worded as the CLI has always said it: what was being done, then why.

use std::path::PathBuf;

use shardline_formats::checkpoint::CheckpointError;
use shardline_formats::execute::ExecuteError;
use shardline_formats::safetensors::SafetensorsError;
use shardline_formats::training::TrainingError;
use shardline_formats::verify::VerifyError;
use shardline_layout::reshard::ReshardError;
use shardline_layout::LayoutError;
use thiserror::Error;

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum OpsError {
    /// A combination of options that means nothing, with what to do instead.
    #[error("{0}")]
    Refused(String),
    #[error("reading release {path}: {source}")]
    Release { path: PathBuf, source: SafetensorsError },
    #[error("reading {path}: {source}")]
    Config { path: PathBuf, source: LayoutError },
    /// Every planning error at once.
    #[error("cannot plan `{model_type}` for mesh {mesh}:\n{}", list(.problems))]
    Plan { model_type: String, mesh: String, problems: Vec<String> },
    #[error("the plan breaks {count} invariant(s); nothing was written:\n{}", list(.shown))]
    Invariants { count: usize, shown: Vec<String> },
    #[error("writing checkpoint to {path}: {source}")]
    Write { path: PathBuf, source: ExecuteError },
    #[error("replacing {path}: {source}")]
    Replace { path: PathBuf, source: ExecuteError },
    #[error("completing the save directory {path}: {source}")]
    SaveDir { path: PathBuf, source: ExecuteError },
    #[error("reading checkpoint {path}: {source}")]
    Checkpoint { path: PathBuf, source: CheckpointError },
    #[error("reading checkpoint {path}: {source}")]
    Verify { path: PathBuf, source: VerifyError },
    #[error("reading checkpoint {path}: {source}")]
    Training { path: PathBuf, source: TrainingError },
    /// Release tensors the checkpoint cannot give back, each said.
    #[error("cannot export {ckpt} as {like}:\n{}", .problems.iter().map(|p| format!("  {p}")).collect::<Vec<_>>().join("\n"))]
    Export { ckpt: PathBuf, like: PathBuf, problems: Vec<String> },
    #[error("cannot reshard {ckpt} to {mesh}: {source}")]
    Reshard { ckpt: PathBuf, mesh: String, source: ReshardError },
    #[error("writing {path}: {source}")]
    Output { path: PathBuf, source: TrainingError },
}

fn list(items: &[String]) -> String {
    items.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n")
}
