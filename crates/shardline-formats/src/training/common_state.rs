//! Megatron-Core `torch_dist`'s common state: the non-sharded part of a save (`args`,
//! `iteration`, `checkpoint_version`, `content_metadata`, the optimizer's and scheduler's
//! non-sharded parts). megatron-core up to 0.18 writes it as `common.pt` next to `.metadata`;
//! later versions as the bytes item `common_state/shard_0_1` holding `[dict]`. A loader prefers
//! `common.pt` when both are there, and so does this.

use std::fs::File;
use std::path::Path;

use super::TrainingError;
use crate::checkpoint::CheckpointError;
use crate::pickle::Value;
use crate::torch_save::read_object_archive;

/// The file that marks a `torch_dist` checkpoint (`{"sharded_backend": "torch_dist", …}`).
pub const METADATA_JSON: &str = "metadata.json";
pub const COMMON_PT: &str = "common.pt";

/// Whether `dir` holds a Megatron-Core `torch_dist` checkpoint (its `metadata.json` says so).
pub fn is_torch_dist(dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(dir.join(METADATA_JSON)) else { return false };
    serde_json::from_str::<serde_json::Value>(&text)
        .is_ok_and(|v| v.get("sharded_backend").and_then(|b| b.as_str()) == Some("torch_dist"))
}

/// `common.pt`'s value, when the checkpoint has one.
pub fn read_common_pt(dir: &Path) -> Result<Option<Value>, TrainingError> {
    let path = dir.join(COMMON_PT);
    let f = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(CheckpointError::Io { path, action: "open", error }.into()),
    };
    let len = f.metadata().map_err(|error| CheckpointError::Io { path: path.clone(), action: "stat", error })?.len();
    read_object_archive(&f, 0, len)
        .map(Some)
        .map_err(|source| TrainingError::Object { key: COMMON_PT.to_string(), source })
}

/// The common dict's entries: `common.pt`'s dict, or the one dict of a `common_state` item.
pub fn common_entries(v: &Value) -> Option<&[(Value, Value)]> {
    match v {
        Value::Dict(items) => Some(items),
        Value::List(items) if items.len() == 1 => common_entries(&items[0]),
        _ => None,
    }
}

/// The entry `name` of the common dict.
pub fn common_entry<'a>(entries: &'a [(Value, Value)], name: &str) -> Option<&'a Value> {
    entries.iter().rev().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v)
}
