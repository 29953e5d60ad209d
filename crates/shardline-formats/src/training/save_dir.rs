//! A Megatron-LM save directory around a `torch_dist` checkpoint (torch-dist.md §1): the
//! tracker `latest_checkpointed_iteration.txt`, and next to the DCP files of the checkpoint
//! directory `common.pt` (the common state) and `metadata.json` (the backend marker).
//!
//! Written in the order that keeps every reader safe: the DCP files and `.metadata` first (a
//! DCP reader's commit point), then `common.pt`, then `metadata.json` (what Megatron-Core's
//! `verify_checkpoint` requires), then the tracker, Megatron-LM's commit point — each through a
//! temporary name, synced and renamed.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use shardline_layout::{Mesh, ModelConfig};

use super::common_state::{COMMON_PT, METADATA_JSON};
use crate::execute::ExecuteError;
use crate::torch_save::{encode_object_archive, PyObject};

/// The tracker file in a save directory.
pub const TRACKER: &str = "latest_checkpointed_iteration.txt";

/// The checkpoint directory a seed checkpoint goes in: `release/`. Megatron-LM's
/// `read_metadata` accepts iteration 0 only as `release` (an integer must be positive), and a
/// release checkpoint is loaded without optimizer and RNG state, which a seed does not have:
/// `--load` then works with no `--finetune` or `--no-load-optim` flags.
pub const RELEASE_DIR: &str = "release";

/// The `metadata.json` every Megatron-Core version loads: 0.18 and older pass its fields to a
/// dataclass without filtering, so it holds exactly these four.
pub const METADATA_JSON_TEXT: &str = r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#;

/// What `args` of a seed checkpoint records: the mesh it was written for and the model's
/// dimensions, the fields Megatron-LM's `check_checkpoint_args` and loaders read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeedArgs {
    pub tp: u64,
    pub cp: u64,
    pub dp: u64,
    pub ep: u64,
    pub etp: u64,
    pub num_layers: u64,
    pub hidden_size: u64,
    pub ffn_hidden_size: Option<u64>,
    pub num_attention_heads: u64,
    pub num_query_groups: u64,
    pub kv_channels: u64,
    pub vocab_size: u64,
    pub padded_vocab_size: u64,
    pub make_vocab_size_divisible_by: u64,
    pub untie_embeddings_and_output_weights: bool,
    pub num_experts: u64,
    pub moe_ffn_hidden_size: Option<u64>,
    pub max_position_embeddings: Option<u64>,
}

fn int(v: u64) -> PyObject {
    PyObject::Int(i128::from(v))
}

fn opt(v: Option<u64>) -> PyObject {
    v.map_or(PyObject::None, int)
}

impl SeedArgs {
    /// The `args` of a seed of `config` (`config_json` the release's `config.json`, for the
    /// fields the planner does not read) for `mesh`, the vocabulary padded to a multiple of
    /// `vocab_divisible_by · tp`.
    pub fn for_model(config: &ModelConfig, config_json: &str, mesh: Mesh, vocab_divisible_by: u64) -> SeedArgs {
        let json: serde_json::Value = serde_json::from_str(config_json).unwrap_or_default();
        let text = json.get("text_config").filter(|t| t.is_object()).unwrap_or(&json);
        let multiple = vocab_divisible_by.max(1) * mesh.tp;
        SeedArgs {
            tp: mesh.tp,
            cp: mesh.cp,
            dp: mesh.dp,
            ep: mesh.ep,
            etp: mesh.etp,
            num_layers: config.num_layers,
            hidden_size: config.hidden_size,
            ffn_hidden_size: config.ffn_hidden_size,
            num_attention_heads: config.num_attention_heads,
            num_query_groups: config.num_query_groups,
            kv_channels: config.head_dim,
            vocab_size: config.vocab_size,
            padded_vocab_size: config.vocab_size.div_ceil(multiple) * multiple,
            make_vocab_size_divisible_by: vocab_divisible_by,
            untie_embeddings_and_output_weights: !config.tie_word_embeddings,
            num_experts: config.num_experts,
            moe_ffn_hidden_size: config.moe_ffn_hidden_size,
            max_position_embeddings: text.get("max_position_embeddings").and_then(serde_json::Value::as_u64),
        }
    }

    /// `args` as the `argparse.Namespace` Megatron-LM pickles. No optimizer or RNG state is
    /// saved, and `args` says so, so a loader does not ask for them.
    pub fn namespace(&self) -> PyObject {
        let s = |v: &str| PyObject::Str(v.to_string());
        let mut state: Vec<(&str, PyObject)> = vec![
            ("tensor_model_parallel_size", int(self.tp)),
            ("pipeline_model_parallel_size", int(1)),
            ("context_parallel_size", int(self.cp)),
            ("data_parallel_size", int(self.dp)),
            ("world_size", int(self.tp * self.cp * self.dp)),
            ("expert_model_parallel_size", int(self.ep)),
            ("expert_tensor_parallel_size", int(self.etp)),
            ("num_layers", int(self.num_layers)),
            ("hidden_size", int(self.hidden_size)),
            ("ffn_hidden_size", opt(self.ffn_hidden_size)),
            ("num_attention_heads", int(self.num_attention_heads)),
            ("group_query_attention", PyObject::Bool(self.num_query_groups != self.num_attention_heads)),
            ("num_query_groups", int(self.num_query_groups)),
            ("kv_channels", int(self.kv_channels)),
            ("vocab_size", int(self.vocab_size)),
            ("padded_vocab_size", int(self.padded_vocab_size)),
            ("make_vocab_size_divisible_by", int(self.make_vocab_size_divisible_by)),
            ("untie_embeddings_and_output_weights", PyObject::Bool(self.untie_embeddings_and_output_weights)),
            ("add_position_embedding", PyObject::Bool(false)),
            ("position_embedding_type", s("rope")),
            ("max_position_embeddings", opt(self.max_position_embeddings)),
            ("swiglu", PyObject::Bool(true)),
            ("normalization", s("RMSNorm")),
            ("num_experts", if self.num_experts == 0 { PyObject::None } else { int(self.num_experts) }),
            ("moe_ffn_hidden_size", opt(self.moe_ffn_hidden_size)),
            ("bf16", PyObject::Bool(true)),
            ("ckpt_format", s("torch_dist")),
            ("no_save_optim", PyObject::Bool(true)),
            ("no_save_rng", PyObject::Bool(true)),
            ("iteration", int(0)),
            ("consumed_train_samples", int(0)),
            ("skipped_train_samples", int(0)),
            ("consumed_valid_samples", int(0)),
        ];
        PyObject::Object {
            module: "argparse".into(),
            class: "Namespace".into(),
            state: state.drain(..).map(|(k, v)| (k.to_string(), v)).collect(),
        }
    }

    /// The common state of a seed checkpoint: `args`, `checkpoint_version` 3.0, iteration 0, and
    /// the `content_metadata` that tells a loader how the state dict is laid out.
    pub fn common_state(&self) -> PyObject {
        PyObject::Dict(vec![
            ("args".into(), self.namespace()),
            ("checkpoint_version".into(), PyObject::Float(3.0)),
            ("iteration".into(), int(0)),
            ("num_floating_point_operations_so_far".into(), int(0)),
            (
                "content_metadata".into(),
                PyObject::Dict(vec![
                    ("singleton_local_shards".into(), PyObject::Bool(false)),
                    ("chained_optim_avoid_prefix".into(), PyObject::Bool(true)),
                ]),
            ),
        ])
    }
}

fn io_err(path: &Path, action: &'static str) -> impl FnOnce(std::io::Error) -> ExecuteError {
    let path = path.to_path_buf();
    move |error| ExecuteError::Io { path, action, error }
}

/// Writes `bytes` to `dir/name` through a temporary name, synced, renamed, directory synced.
fn write_durably(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), ExecuteError> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let path = dir.join(name);
    let mut f = File::create(&tmp).map_err(io_err(&tmp, "create"))?;
    f.write_all(bytes).map_err(io_err(&tmp, "write"))?;
    f.sync_all().map_err(io_err(&tmp, "sync"))?;
    fs::rename(&tmp, &path).map_err(io_err(&path, "rename into place"))?;
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir, "sync directory"))
}

/// The checkpoint directory of a seed save in `root`.
pub fn seed_dir(root: &Path) -> PathBuf {
    root.join(RELEASE_DIR)
}

/// Removes the tracker of a save directory first, so that a save being replaced is never
/// pointed at while it is rewritten.
pub fn withdraw_tracker(root: &Path) -> Result<(), ExecuteError> {
    let path = root.join(TRACKER);
    match fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(&path, "remove old tracker")(e)),
    }
}

/// Completes a seed save whose DCP checkpoint is in [`seed_dir`]: `common.pt`, `metadata.json`,
/// then the tracker.
pub fn finish_seed_save(root: &Path, args: &SeedArgs) -> Result<(), ExecuteError> {
    finish_save(root, RELEASE_DIR, &encode_object_archive(&args.common_state()))
}

/// Completes a save whose DCP checkpoint is in `root/dir_name` (`release` or `iter_%07d`):
/// `common.pt` (the `torch.save` archive `common`), `metadata.json`, then the tracker naming it.
pub fn finish_save(root: &Path, dir_name: &str, common: &[u8]) -> Result<(), ExecuteError> {
    let dir = root.join(dir_name);
    write_durably(&dir, COMMON_PT, common)?;
    write_durably(&dir, METADATA_JSON, METADATA_JSON_TEXT.as_bytes())?;
    let tracker = dir_name.strip_prefix("iter_").map_or(dir_name, |n| n.trim_start_matches('0'));
    write_durably(root, TRACKER, tracker.as_bytes())
}
