//! The recorded output of a task: what the engine's steps write when a task succeeds, and what
//! later tasks, the step cache, the dashboard and the CLI read back. Each role fills the fields
//! it knows (a download its `path`, a plan its `plan_digest` and `bytes_per_rank`, a commit its
//! `dir`, …); what no reader needs by name (a Hub snapshot's file list, an upload's counts) is
//! kept in `rest`, so an output read and written again keeps every field it had.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use shardline_store::ScratchNeed;

/// A task's output. Serializes to the JSON object stored with the task (absent fields are left
/// out).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TaskOutput {
    /// A download: the directory later steps read the release from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// A download: the content digest of the release (the shard step's cache key reads it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Bytes of the release (a download), of a rank file (a rank), of the checkpoint (a commit,
    /// a reshard), of the release written (an export) or copied (an upload).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// A download from the Hub: bytes fetched over the network (the rest were reused from the
    /// local cache).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_downloaded: Option<u64>,
    /// Files of the release (a download) or published (an upload).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<u64>,
    /// A download: every file with its size (what a cached download is checked against).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file_list: Option<Vec<ListedFile>>,
    /// A download: what the manifest of a publish records as the checkpoint's source (a local
    /// release has none: its whole output describes it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<Value>,
    /// A validation: bytes reconstructed and compared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_checked: Option<u64>,
    /// A plan: the digest rank and commit tasks check the plan they rebuild against.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan_digest: Option<String>,
    /// A plan: the tensor bytes each rank file will hold.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_per_rank: Option<Vec<u64>>,
    /// A checkpoint (commit, validation): its directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    /// A plan or checkpoint: the mesh it was written for (`tp2·cp1·dp4·ep1·etp2`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mesh: Option<String>,
    /// A plan or checkpoint: ranks in the mesh.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub world: Option<u64>,
    /// A plan or checkpoint: tensors written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keys: Option<u64>,
    /// A plan or checkpoint: whether fused projections were split.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split_fused: Option<bool>,
    /// An upload: where it published (the step's `to:`, resolved).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dest: Option<String>,
    /// An upload: where its manifest is (under `dest`, written last). Not `manifest`: an
    /// object-store download records whether its prefix had one under that name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub manifest_url: Option<String>,
    /// An upload: bytes the manifest lists (copied now or already there), where `bytes` counts
    /// only those copied.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub published_bytes: Option<u64>,
    /// The step-cache key this output is (or will be) remembered under.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_key: Option<String>,
    /// A command: the JSON object it wrote to `result.json` in its output directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Map<String, Value>>,
    /// A command: its exit code (0: it succeeded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// With an object-store artifact store: the output's prefix there (a release, a checkpoint),
    /// where tasks on any host read it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub artifact: Option<String>,
    /// A download on an artifact store: the prefix holding a copy of each safetensors file's
    /// header (its first `8 + n` bytes), named by the SHA-256 of the file's URL, name and ETag,
    /// so later tasks read them as small objects instead of ranges of large ones.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headers: Option<String>,
    /// A rank task writing to an artifact store: its rank file's multipart upload, left open for
    /// the commit to complete.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upload: Option<PartUpload>,
    /// A part of a split validation: the fingerprint of the chunk boxes its items hold, summed
    /// with the other parts' and compared with `.metadata`'s by the validation task.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boxes_held: Option<BoxFingerprint>,
    /// Served from the step cache: `true`, or (a plan task) the cached checkpoint's output.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached: Option<Value>,
    /// Every other field, as written.
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// An object uploaded in parts whose multipart upload is still open.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartUpload {
    /// The object's name under the output's `artifact` prefix.
    pub name: String,
    pub upload_id: String,
    /// The parts' ids, in order.
    pub parts: Vec<String>,
    pub size: u64,
}

/// An order-independent fingerprint of a set of chunk boxes: how many, and the sum of their
/// 128-bit digests in hex (a JSON number does not hold 128 bits).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoxFingerprint {
    pub count: u64,
    pub sum: String,
}

/// A file of a downloaded source, as its download lists it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ListedFile {
    /// Relative to the output's `path`.
    pub path: String,
    pub size: u64,
    /// What else the download knows of it (SHA-256, blob name, ETag), as written.
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

impl TaskOutput {
    /// Reads a stored output. A field whose value is not of its type (an output written by
    /// another version, an object-store download's boolean `manifest` next to a typed field of
    /// that name) is kept as written among the untyped fields, never read as a default, and the
    /// other fields are read as usual; a non-object reads as an empty output.
    pub fn from_value(v: &Value) -> TaskOutput {
        if let Ok(output) = serde_json::from_value(v.clone()) {
            return output;
        }
        let Some(fields) = v.as_object() else { return TaskOutput::default() };
        let (mut typed, mut odd) = (Map::new(), Map::new());
        for (key, value) in fields {
            let alone = Value::Object(Map::from_iter([(key.clone(), value.clone())]));
            match serde_json::from_value::<TaskOutput>(alone) {
                Ok(_) => typed.insert(key.clone(), value.clone()),
                Err(_) => odd.insert(key.clone(), value.clone()),
            };
        }
        let mut output: TaskOutput = serde_json::from_value(Value::Object(typed)).unwrap_or_default();
        output.rest.extend(odd);
        output
    }

    /// The JSON stored with the task.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// Keeps `value` under `key` among the fields no reader needs by name.
    pub fn with(mut self, key: &str, value: Value) -> TaskOutput {
        self.rest.insert(key.to_string(), value);
        self
    }

    /// Whether the task was served from the step cache.
    pub fn is_cached(&self) -> bool {
        self.cached.is_some()
    }

    /// A plan's output read as the scratch its rank tasks need: each about its rank file's
    /// bytes — the tensor bytes the plan counts, plus [`rank_file_headroom`] for the file's
    /// framing. Empty when the plan records no sizes (served from the step cache: its rank
    /// tasks write nothing). The commit task gets none: it writes only `.metadata`, small next
    /// to the rank files, which are on the disk by then and in every measurement of it.
    pub fn rank_scratch_needs(&self, plan_task: &str) -> Vec<ScratchNeed> {
        let Some(per_rank) = &self.bytes_per_rank else { return Vec::new() };
        per_rank
            .iter()
            .zip(0u64..)
            .map(|(&bytes, rank)| ScratchNeed {
                task: crate::graph::rank_task(plan_task, rank),
                bytes: bytes.saturating_add(rank_file_headroom(bytes)),
            })
            .collect()
    }
}

/// Bytes a rank file holds beyond its tensor data: each item's zip and pickle framing and
/// alignment. Estimated as 1/64 of the data plus 1 MiB, which covers many small tensors (a few
/// hundred bytes each) as well as few large ones.
pub fn rank_file_headroom(tensor_bytes: u64) -> u64 {
    tensor_bytes / 64 + (1 << 20)
}

/// What a running task reports with each heartbeat.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskProgress {
    /// Bytes written (or downloaded) so far.
    pub bytes: u64,
    #[serde(default)]
    pub chunks: u64,
    #[serde(default)]
    pub files: u64,
    /// Bytes the task will move in all, when it knows (a download does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_total: Option<u64>,
}

impl TaskProgress {
    /// Reads a stored progress report; `None` when it is not one.
    pub fn from_value(v: &Value) -> Option<TaskProgress> {
        serde_json::from_value(v.clone()).ok()
    }

    /// The JSON stored with the task.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_field_of_another_type_is_kept_as_written_and_the_rest_still_read() {
        let v = serde_json::json!({"path": "/r", "bytes": "many", "digest": "d", "upload": 3, "extra": [1]});
        let o = super::TaskOutput::from_value(&v);
        assert_eq!(o.path.as_deref(), Some(std::path::Path::new("/r")));
        assert_eq!(o.digest.as_deref(), Some("d"));
        assert_eq!((o.bytes, o.upload.clone()), (None, None));
        assert_eq!(o.rest.get("bytes"), Some(&serde_json::json!("many")));
        assert_eq!(o.rest.get("upload"), Some(&serde_json::json!(3)));
        assert_eq!(o.rest.get("extra"), Some(&serde_json::json!([1])));
        // Written back, every field is there as it was.
        assert_eq!(o.to_value(), v);
        assert_eq!(super::TaskOutput::from_value(&serde_json::json!(7)), super::TaskOutput::default());
    }

    use serde_json::json;

    use super::*;

    #[test]
    fn round_trips_known_and_other_fields() {
        let v = json!({
            "path": "/c/snap", "digest": "d", "bytes": 12, "files": 3, "cache_key": "k",
            "file_list": [{"path": "a.safetensors", "size": 12, "sha256": null, "blob": "b"}],
            "source": {"kind": "hf.download", "repo": "org/m"}, "cached": true,
        });
        let o = TaskOutput::from_value(&v);
        assert_eq!(o.path.as_deref(), Some(std::path::Path::new("/c/snap")));
        assert_eq!((o.bytes, o.cache_key.as_deref(), o.is_cached()), (Some(12), Some("k"), true));
        assert_eq!((o.files, o.source.as_ref().map(|s| s["repo"].clone())), (Some(3), Some(json!("org/m"))));
        assert!(o.rest.is_empty(), "{:?}", o.rest);
        assert_eq!(o.to_value(), v);
        let plan = json!({"cached": {"dir": "/x", "bytes": 5}, "cache_key": "k", "plan_digest": ""});
        assert_eq!(TaskOutput::from_value(&plan).to_value(), plan);
        assert_eq!(TaskOutput::from_value(&json!(null)), TaskOutput::default());
    }

    #[test]
    fn a_plan_gives_its_rank_tasks_their_file_sizes_as_scratch() {
        let plan = TaskOutput::from_value(&json!({"plan_digest": "d", "bytes_per_rank": [0, 6400, 1u64 << 40]}));
        let needs = plan.rank_scratch_needs("shard");
        let got: Vec<(&str, u64)> = needs.iter().map(|n| (n.task.as_str(), n.bytes)).collect();
        assert_eq!(
            got,
            [
                ("shard/rank-0", 1 << 20),
                ("shard/rank-1", 6400 + 100 + (1 << 20)),
                ("shard/rank-2", (1 << 40) + (1 << 34) + (1 << 20))
            ]
        );
        // The names are the graph's own.
        assert_eq!(crate::graph::rank_task("shard", 1), "shard/rank-1");
        // A cached plan (no sizes) sets nothing.
        let cached = TaskOutput::from_value(&json!({"cached": {"dir": "/x"}, "plan_digest": ""}));
        assert!(cached.rank_scratch_needs("shard").is_empty());
    }
}
