//! A checkpoint in the artifact store read back for a step that needs only some of its keys
//! (`export`: the model, not the optimizer's moments): `.metadata` whole, then, as sparse local
//! files of the rank files' sizes, just the byte ranges of the kept items' archives
//! (`checkpoint::storage_ranges`), fetched with parallel ranged requests pinned to the versions
//! listed. The step then opens the directory with the same key filter, as it would a local one.

use std::fs::{self, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use shardline_formats::checkpoint::storage_ranges;

use shardline_formats::training::common_state::{COMMON_PT, METADATA_JSON};

use crate::remote::{checkpoint_in, open_artifacts, transient};
use crate::steps::{StepContext, StepError};

/// Reads the checkpoint under `url` into `dir` (created; the task's scratch), keeping the bytes
/// of the keys `keep` accepts and of its bytes items. Returns `dir`.
pub fn fetch_sparse(
    url: &str,
    keep: impl Fn(&str) -> bool,
    dir: &Path,
    ctx: &StepContext,
) -> Result<PathBuf, StepError> {
    // A Megatron-LM save directory: the checkpoint its tracker names, whose model keys are bare
    // (everything but `optimizer.…`), and its `metadata.json` and `common.pt` that say what it is.
    let (url, save_dir) = checkpoint_in(url, ctx)?;
    let url = url.as_str();
    let keep = |k: &str| if save_dir { !k.starts_with("optimizer.") } else { keep(k) };
    let artifacts = open_artifacts(url, ctx)?;
    fs::create_dir_all(dir).map_err(|e| transient(format!("{}: {e}", dir.display())))?;
    ctx.runtime.block_on(async {
        let listing = artifacts.list().await.map_err(transient)?;
        for o in listing.iter().filter(|o| save_dir && (o.name == METADATA_JSON || o.name == COMMON_PT)) {
            artifacts.fetch_whole(&o.name, o.e_tag.as_deref(), &dir.join(&o.name)).await.map_err(transient)?;
        }
        let listed = |name: &str| listing.iter().find(|o| o.name == name);
        let metadata = listed(".metadata")
            .ok_or_else(|| StepError::fatal(format!("{url} holds no checkpoint (no `.metadata`)")))?;
        artifacts
            .fetch_whole(".metadata", metadata.e_tag.as_deref(), &dir.join(".metadata"))
            .await
            .map_err(transient)?;
        let ranges = storage_ranges(&dir.join(".metadata"), keep)
            .map_err(|e| StepError::fatal(format!("reading {url}/.metadata: {e}")))?;
        let (mut fetched, mut total) = (0u64, 0u64);
        for (name, wanted) in &ranges {
            let object = listed(name).ok_or_else(|| {
                StepError::fatal(format!("{url}: rank file `{name}` named by `.metadata` is not in the store"))
            })?;
            if let Some((_, end)) = wanted.last().filter(|(_, end)| *end > object.size) {
                return Err(StepError::fatal(format!(
                    "{url}: `{name}` is {} bytes, but `.metadata` places items up to byte {end} (truncated?)",
                    object.size
                )));
            }
            let path = dir.join(name);
            let file = OpenOptions::new()
                .create(true)
                .truncate(true)
                .write(true)
                .open(&path)
                .map_err(|e| transient(format!("{}: {e}", path.display())))?;
            file.set_len(object.size).map_err(|e| transient(format!("{}: {e}", path.display())))?;
            fetched += artifacts
                .fetch_ranges(name, object.e_tag.as_deref(), wanted, Arc::new(file))
                .await
                .map_err(transient)?;
            total += object.size;
        }
        (ctx.log)(format!("read {fetched} of the {total} bytes of {url}'s rank files: the items this step reads"));
        Ok(dir.to_path_buf())
    })
}
