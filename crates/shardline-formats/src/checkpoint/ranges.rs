//! The byte ranges of a DCP checkpoint's rank files that opening it with a key filter reads, so a
//! checkpoint kept in an object store can be read back as sparse local files holding just them
//! (`export` reads the model's tensors: a third of a training checkpoint's bytes, the optimizer's
//! moments being the rest).

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use crate::dcp_metadata::{read_metadata_file, EntryMeta, MetadataItem};

use super::dcp::Stop;
use super::{safe_name, CheckpointError};

/// Per rank file, the sorted, merged `[start, end)` ranges of the storage items of the keys
/// `keep` accepts and of every bytes item (small, and read by whoever reads `args`), as the
/// `.metadata` at `metadata` declares them. Names are checked to stay inside the checkpoint.
pub fn storage_ranges(
    metadata: &Path,
    keep: impl Fn(&str) -> bool,
) -> Result<BTreeMap<String, Vec<(u64, u64)>>, CheckpointError> {
    let mut bytes_items = HashSet::new();
    let mut ranges: BTreeMap<String, Vec<(u64, u64)>> = BTreeMap::new();
    let mut on_item = |item: MetadataItem| -> Result<(), Stop> {
        match item {
            MetadataItem::Entry(key, EntryMeta::Bytes) => {
                bytes_items.insert(key);
            }
            MetadataItem::Storage(key, info) if bytes_items.contains(&key.fqn) || keep(&key.fqn) => {
                safe_name(&info.relative_path).map_err(Stop::Checkpoint)?;
                let end = info.offset.checked_add(info.length).ok_or_else(|| {
                    Stop::Checkpoint(CheckpointError::Inconsistent {
                        key: key.fqn.clone(),
                        offsets: key.offset.clone().unwrap_or_default(),
                        message: format!("storage item at {} of {} bytes overflows", info.offset, info.length),
                    })
                })?;
                ranges.entry(info.relative_path).or_default().push((info.offset, end));
            }
            _ => {}
        }
        Ok(())
    };
    read_metadata_file(metadata, &mut on_item).map_err(|e| match e {
        Stop::Metadata(source) => CheckpointError::Metadata { path: metadata.to_path_buf(), source },
        Stop::Checkpoint(e) => e,
    })?;
    for list in ranges.values_mut() {
        *list = merged(std::mem::take(list));
    }
    Ok(ranges)
}

/// `ranges` sorted, touching and overlapping ones joined.
fn merged(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::merged;

    #[test]
    fn touching_and_overlapping_ranges_are_joined() {
        assert_eq!(merged(vec![(10, 20), (0, 5), (5, 8), (15, 30), (40, 41)]), vec![(0, 8), (10, 30), (40, 41)]);
        assert_eq!(merged(vec![]), vec![]);
    }
}
