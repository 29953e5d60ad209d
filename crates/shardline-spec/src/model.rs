//! The types of a pipeline: as written ([`Pipeline`], lint-clean but not yet instantiated) and as
//! run ([`ResolvedPipeline`], every value concrete and typed).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::template::Template;
use crate::yaml::Span;
use shardline_units::{format_duration, format_size};

/// The only `apiVersion` this crate reads.
pub const API_VERSION: &str = "shardline/v1";
/// The only `kind` this crate reads.
pub const KIND: &str = "Pipeline";

/// A built-in step kind, named in YAML by its dotted name (`uses: megatron.shard`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum StepKind {
    /// `hf.download`: a release from the Hub (`repo`, `revision`, `allow`, `ignore`, `endpoint`) or
    /// a local HF-layout directory (`path`: config.json + safetensors [+ index]).
    #[serde(rename = "hf.download")]
    HfDownload,
    /// `megatron.shard`: convert to a sharded checkpoint for a mesh.
    #[serde(rename = "megatron.shard")]
    MegatronShard,
    /// `megatron.split_fused`: split fused parameters of the shard step's output.
    #[serde(rename = "megatron.split_fused")]
    MegatronSplitFused,
    /// `checkpoint.reshard`: a checkpoint (with optimizer state) re-tiled for another mesh.
    #[serde(rename = "checkpoint.reshard")]
    CheckpointReshard,
    /// `checkpoint.validate`: bit-exact validation against the source release.
    #[serde(rename = "checkpoint.validate")]
    CheckpointValidate,
    /// `checkpoint.export`: a checkpoint's model weights written back as an HF release.
    #[serde(rename = "checkpoint.export")]
    CheckpointExport,
    /// `store.upload`: copy the checkpoint to a store.
    #[serde(rename = "store.upload")]
    StoreUpload,
    /// `command`: a program run as an argv (`run`), or a script with `shell: true`, with the
    /// outputs of the steps it needs in its environment; its exit code decides success.
    #[serde(rename = "command")]
    Command,
}

impl StepKind {
    /// Every kind, in pipeline order.
    pub const ALL: [StepKind; 8] = [
        StepKind::HfDownload,
        StepKind::MegatronShard,
        StepKind::MegatronSplitFused,
        StepKind::CheckpointReshard,
        StepKind::CheckpointValidate,
        StepKind::CheckpointExport,
        StepKind::StoreUpload,
        StepKind::Command,
    ];

    /// The dotted name used in YAML.
    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::HfDownload => "hf.download",
            StepKind::MegatronShard => "megatron.shard",
            StepKind::MegatronSplitFused => "megatron.split_fused",
            StepKind::CheckpointReshard => "checkpoint.reshard",
            StepKind::CheckpointValidate => "checkpoint.validate",
            StepKind::CheckpointExport => "checkpoint.export",
            StepKind::StoreUpload => "store.upload",
            StepKind::Command => "command",
        }
    }

    /// Whether the step's output is a sharded checkpoint (what `checkpoint.reshard`,
    /// `checkpoint.validate` and `checkpoint.export` read).
    pub fn writes_checkpoint(self) -> bool {
        matches!(self, StepKind::MegatronShard | StepKind::MegatronSplitFused | StepKind::CheckpointReshard)
    }

    pub(crate) fn names() -> Vec<&'static str> {
        StepKind::ALL.iter().map(|k| k.as_str()).collect()
    }
}

impl fmt::Display for StepKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A step kind name that is not one of [`StepKind::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown step kind `{name}` (known: {})", crate::suggest::list(&StepKind::names()))]
pub struct UnknownStepKind {
    pub name: String,
}

impl FromStr for StepKind {
    type Err = UnknownStepKind;
    fn from_str(s: &str) -> Result<StepKind, UnknownStepKind> {
        StepKind::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| UnknownStepKind { name: s.to_string() })
    }
}

/// Output format of `megatron.shard`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum OutputFormatName {
    /// Torch DCP `.distcp` rank files.
    #[serde(rename = "dcp")]
    Dcp,
    /// DCP metadata with safetensors rank files.
    #[serde(rename = "dcp-safetensors")]
    DcpSafetensors,
}

impl OutputFormatName {
    pub const ALL: [OutputFormatName; 2] = [OutputFormatName::Dcp, OutputFormatName::DcpSafetensors];
    pub(crate) const NAMES: &'static [&'static str] = &["dcp", "dcp-safetensors"];

    pub fn as_str(self) -> &'static str {
        match self {
            OutputFormatName::Dcp => "dcp",
            OutputFormatName::DcpSafetensors => "dcp-safetensors",
        }
    }
}

impl fmt::Display for OutputFormatName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An output format name that is not `dcp` or `dcp-safetensors`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown output format `{name}` (known: `dcp`, `dcp-safetensors`)")]
pub struct UnknownOutputFormat {
    pub name: String,
}

impl FromStr for OutputFormatName {
    type Err = UnknownOutputFormat;
    fn from_str(s: &str) -> Result<OutputFormatName, UnknownOutputFormat> {
        OutputFormatName::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownOutputFormat { name: s.to_string() })
    }
}

/// What `checkpoint.reshard` does with the per-TP-rank RNG states (`rng`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum RngPolicyName {
    /// Keep the ranks both grids have; a new TP rank gets a copy of rank 0's state.
    #[serde(rename = "from-rank0")]
    FromRank0,
    /// Drop every RNG state (the job loads with `--no-load-rng`).
    #[serde(rename = "drop")]
    Drop,
}

impl RngPolicyName {
    pub(crate) const NAMES: &'static [&'static str] = &["from-rank0", "drop"];

    pub fn as_str(self) -> &'static str {
        match self {
            RngPolicyName::FromRank0 => "from-rank0",
            RngPolicyName::Drop => "drop",
        }
    }
}

impl fmt::Display for RngPolicyName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The type of a pipeline param.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ParamType {
    String,
    Int,
    Bool,
    Path,
    /// A byte size such as `4GiB`.
    Size,
    /// A duration such as `90s` or `2h`.
    Duration,
}

impl ParamType {
    pub const ALL: [ParamType; 6] =
        [ParamType::String, ParamType::Int, ParamType::Bool, ParamType::Path, ParamType::Size, ParamType::Duration];

    pub fn as_str(self) -> &'static str {
        match self {
            ParamType::String => "string",
            ParamType::Int => "int",
            ParamType::Bool => "bool",
            ParamType::Path => "path",
            ParamType::Size => "size",
            ParamType::Duration => "duration",
        }
    }
}

impl fmt::Display for ParamType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A param type name that is not one of [`ParamType::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown param type `{name}` (known: `string`, `int`, `bool`, `path`, `size`, `duration`)")]
pub struct UnknownParamType {
    pub name: String,
}

impl FromStr for ParamType {
    type Err = UnknownParamType;
    fn from_str(s: &str) -> Result<ParamType, UnknownParamType> {
        ParamType::ALL.into_iter().find(|t| t.as_str() == s).ok_or_else(|| UnknownParamType { name: s.to_string() })
    }
}

/// A typed param value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ParamValue {
    String(String),
    Int(i64),
    Bool(bool),
    Path(PathBuf),
    /// Bytes.
    Size(u64),
    Duration(Duration),
}

impl ParamValue {
    pub fn ty(&self) -> ParamType {
        match self {
            ParamValue::String(_) => ParamType::String,
            ParamValue::Int(_) => ParamType::Int,
            ParamValue::Bool(_) => ParamType::Bool,
            ParamValue::Path(_) => ParamType::Path,
            ParamValue::Size(_) => ParamType::Size,
            ParamValue::Duration(_) => ParamType::Duration,
        }
    }

    /// The JSON form stored with a run: strings and paths as strings, ints and bools as such,
    /// sizes and durations in their canonical spelling (`4GiB`, `90s`).
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            ParamValue::Int(i) => serde_json::Value::from(*i),
            ParamValue::Bool(b) => serde_json::Value::from(*b),
            other => serde_json::Value::from(other.to_string()),
        }
    }
}

impl fmt::Display for ParamValue {
    /// The canonical spelling, which is also what a partial interpolation inserts.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamValue::String(s) => f.write_str(s),
            ParamValue::Int(i) => write!(f, "{i}"),
            ParamValue::Bool(b) => write!(f, "{b}"),
            ParamValue::Path(p) => write!(f, "{}", p.display()),
            ParamValue::Size(n) => f.write_str(&format_size(*n)),
            ParamValue::Duration(d) => f.write_str(&format_duration(*d)),
        }
    }
}

/// A declared param.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: String,
    pub ty: ParamType,
    /// `None`: the param must be set with `--set NAME=VALUE`.
    pub default: Option<ParamValue>,
    /// The allowed values (`enum:`); empty when any value of the type is allowed.
    pub choices: Vec<ParamValue>,
    pub description: Option<String>,
}

/// A value as written in the spec, before params are substituted.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SpecValue {
    Bool(bool),
    Int(i64),
    String(String),
    /// A string with `${{ … }}` interpolations.
    Template(Template),
    /// A sequence of the above (`allow: ["*.json", "*.safetensors"]`).
    List(Vec<SpecValue>),
    /// A mapping of names to the above, in file order (a command's `env`).
    Map(Vec<(String, SpecValue)>),
}

impl SpecValue {
    /// The interpolations in this value (and, for a list, in its items).
    pub fn templates(&self) -> Vec<&Template> {
        match self {
            SpecValue::Template(t) => vec![t],
            SpecValue::List(items) => items.iter().flat_map(SpecValue::templates).collect(),
            SpecValue::Map(entries) => entries.iter().flat_map(|(_, v)| v.templates()).collect(),
            _ => Vec::new(),
        }
    }
}

/// A step as written. Values are checked against their field's type but may still hold
/// interpolations; [`Pipeline::instantiate`] makes them concrete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepSpec {
    pub id: String,
    pub kind: StepKind,
    pub needs: Vec<String>,
    /// `with` fields as written (absent fields take their defaults at instantiation).
    pub with: BTreeMap<String, SpecValue>,
    /// `resources` fields as written: `cpus`, `memory`, `gpus`, `scratch`.
    pub resources: BTreeMap<String, SpecValue>,
    /// `retry` fields as written: `attempts`, `lost`, `backoff`.
    pub retry: BTreeMap<String, SpecValue>,
    pub timeout: Option<SpecValue>,
    pub cache: Option<SpecValue>,
}

/// A line and column (1-based) in the pipeline file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Location {
    pub line: usize,
    pub column: usize,
}

/// Where each key path (`steps[1].with.tp`) was written: its key and its value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Locations {
    pub keys: BTreeMap<String, Span>,
    pub values: BTreeMap<String, Span>,
}

impl Locations {
    /// The value of `path`, else where it would go: the nearest written ancestor's key, else that
    /// ancestor's value, else the start of the file.
    pub fn span(&self, path: &str) -> Span {
        if let Some(s) = self.values.get(path) {
            return *s;
        }
        self.missing(path)
    }

    /// The key of `path`, else as [`Locations::span`].
    pub fn key(&self, path: &str) -> Span {
        self.keys.get(path).copied().unwrap_or_else(|| self.span(path))
    }

    /// Where a missing `path` would be added.
    pub fn missing(&self, path: &str) -> Span {
        let mut p = path;
        while let Some(parent) = parent(p) {
            if parent.is_empty() {
                break;
            }
            if let Some(s) = self.keys.get(parent).or_else(|| self.values.get(parent)) {
                return *s;
            }
            p = parent;
        }
        // The start of the document.
        self.values.get("").map(|s| Span::point(s.line, s.col)).unwrap_or(Span::point(1, 1))
    }
}

/// `steps[1].with.tp` → `steps[1].with` → `steps[1]` → `steps` → none.
pub(crate) fn parent(path: &str) -> Option<&str> {
    if path.is_empty() {
        return None;
    }
    let cut = path.rfind(['.', '[']).unwrap_or(0);
    Some(&path[..cut])
}

/// A lint-clean pipeline spec. Obtained from [`crate::lint`]; turned into a runnable
/// [`ResolvedPipeline`] by [`Pipeline::instantiate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pipeline {
    pub name: String,
    pub description: Option<String>,
    pub params: Vec<ParamSpec>,
    pub steps: Vec<StepSpec>,
    /// What starts runs without a submission (`triggers:`), in file order.
    pub triggers: Vec<crate::triggers::Trigger>,
    /// Webhooks told when a run finishes or a trigger fails (`notify:`), in file order.
    pub notify: Vec<crate::notify::NotifyTarget>,
    /// `concurrency:`, `pool:` and `priority:`.
    pub limits: crate::run_limits::RunLimits,
    /// `retention:` (how long its finished runs' work directories are kept).
    pub retention: crate::retention::Retention,
    /// The file name diagnostics are reported against.
    pub file: String,
    pub(crate) locations: Locations,
    /// Index in the file's `steps` of each of `steps`.
    pub(crate) step_index: Vec<usize>,
}

impl Pipeline {
    /// Where the value at a key path (`steps[1].with.tp`, `params.tp.default`) was written.
    pub fn location(&self, path: &str) -> Option<Location> {
        self.locations.values.get(path).map(|s| Location { line: s.line, column: s.col })
    }

    pub fn param(&self, name: &str) -> Option<&ParamSpec> {
        self.params.iter().find(|p| p.name == name)
    }

    pub fn step(&self, id: &str) -> Option<&StepSpec> {
        self.steps.iter().find(|s| s.id == id)
    }
}

/// Resources a step asks of the worker that leases it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Resources {
    pub cpus: u32,
    pub memory_bytes: u64,
    pub gpus: u32,
    pub scratch_bytes: u64,
}

impl Default for Resources {
    /// `{cpus: 1, memory: 1GiB, gpus: 0, scratch: 0}`
    fn default() -> Resources {
        Resources { cpus: 1, memory_bytes: 1 << 30, gpus: 0, scratch_bytes: 0 }
    }
}

/// How many lost leases a step's task may have unless its `retry.lost` says otherwise.
pub const DEFAULT_LOST: u32 = 10;

/// Retry policy, with two budgets: at most `attempts` tries that fail (the task's error or
/// timeout; the first try included), and at most `lost` leases lost (the worker running it died,
/// was preempted or lost the store, so its lease expired). Each retry waits an exponential
/// backoff with jitter whose base is `backoff`, doubling with its own budget's count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Retry {
    pub attempts: u32,
    /// Left out of the serialized form at its default, so that specs written before it existed
    /// keep their hashes (and their step cache keys); read back as the default when absent.
    #[serde(default = "default_lost", skip_serializing_if = "is_default_lost")]
    pub lost: u32,
    pub backoff: Duration,
}

fn default_target() -> String {
    "fsdp_dtensor".to_string()
}

fn is_default_target(target: &str) -> bool {
    target == "fsdp_dtensor"
}

fn default_lost() -> u32 {
    DEFAULT_LOST
}

fn is_default_lost(lost: &u32) -> bool {
    *lost == DEFAULT_LOST
}

impl Default for Retry {
    /// `{attempts: 3, lost: 10, backoff: 5s}`
    fn default() -> Retry {
        Retry { attempts: 3, lost: DEFAULT_LOST, backoff: Duration::from_secs(5) }
    }
}

/// The concrete, typed configuration of a step.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind")]
pub enum StepConfig {
    #[serde(rename = "hf.download")]
    HfDownload {
        #[serde(flatten)]
        source: DownloadSource,
    },
    #[serde(rename = "megatron.shard")]
    MegatronShard {
        tp: u64,
        cp: u64,
        dp: u64,
        ep: u64,
        etp: u64,
        format: OutputFormatName,
        /// The checkpoint dialect: `fsdp_dtensor` or `torch_dist`. Left out of the serialized
        /// form at its default, so that specs written before it existed keep their hashes (and
        /// their step cache keys); read back as the default when absent.
        #[serde(default = "default_target", skip_serializing_if = "is_default_target")]
        target: String,
        /// With `target: torchtitan`, the torchtitan version whose names are written (`main`
        /// when empty); left out of the serialized form when empty, as `target` is.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        torchtitan_version: String,
        prefix: String,
        optimizer_state: bool,
        vocab_divisible_by: u64,
        keep: bool,
    },
    #[serde(rename = "megatron.split_fused")]
    MegatronSplitFused { keep: bool },
    /// Validates against the source of the upstream `hf.download` step
    /// ([`ResolvedPipeline::source_of`]).
    #[serde(rename = "checkpoint.validate")]
    CheckpointValidate {},
    /// Reads `source` (`path`), else the checkpoint of the step it needs
    /// ([`StepKind::writes_checkpoint`]); writes it for the mesh `tp`…`etp`.
    #[serde(rename = "checkpoint.reshard")]
    CheckpointReshard {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        source: Option<CheckpointSource>,
        tp: u64,
        cp: u64,
        dp: u64,
        ep: u64,
        etp: u64,
        rng: RngPolicyName,
        /// The tokenizer's vocabulary size, to re-pad the embedding and output layer; `None`:
        /// the checkpoint's `args`, else the upstream release's `config.json`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vocab_size: Option<u64>,
        /// The source mesh as assignments (`tp=2,cp=1,dp=4,ep=1,etp=2`, every dimension
        /// written); `None`: the checkpoint's `args`, else the mesh its step wrote.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from_mesh: Option<String>,
        /// The dialect to write: `fsdp_dtensor` translates a `torch_dist` source; `None` keeps
        /// the source's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        target: Option<String>,
    },
    /// Writes the checkpoint of the step it needs as the HF release `like` (else the upstream
    /// download's).
    #[serde(rename = "checkpoint.export")]
    CheckpointExport {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        like: Option<PathBuf>,
        /// `None`: the checkpoint's `args`, else the mesh its step wrote, else 1.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        etp: Option<u64>,
        max_file_size: u64,
        /// Tasks the weight files are written by, file `i` by part `i mod parts` (on a local or
        /// shared file system; one task on an object-store artifact store), then one committing.
        #[serde(default = "one")]
        parts: u64,
    },
    #[serde(rename = "store.upload")]
    StoreUpload { to: String },
    /// Runs `run` (an argv; with `shell`, one script for `/bin/sh -c`) in `workdir` (relative to
    /// the submitting directory; `None`: that directory) with `env` and the worker's variables
    /// named in `inherit` added to a minimal environment.
    #[serde(rename = "command")]
    Command {
        run: Vec<String>,
        shell: bool,
        env: BTreeMap<String, String>,
        inherit: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        workdir: Option<PathBuf>,
    },
}

/// Where a `checkpoint.reshard` step with a `path` reads its checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CheckpointSource {
    /// The objects under an object-store prefix (`s3://…`, `gs://…`, `az://…`, `file:///…`),
    /// downloaded into a local cache as `hf.download` downloads them.
    ObjectStore { url: String },
    /// A local checkpoint directory, read in place.
    Local { path: PathBuf },
}

/// Where an `hf.download` step reads its release.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DownloadSource {
    /// A Hub repository at a revision, the files selected by `allow` then `ignore` (empty `allow`
    /// keeps every file).
    Hub {
        repo: String,
        revision: String,
        #[serde(default)]
        allow: Vec<String>,
        #[serde(default)]
        ignore: Vec<String>,
        /// `None`: `HF_ENDPOINT`, else `https://huggingface.co`, read where the step runs.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        endpoint: Option<String>,
    },
    /// The objects under an object-store prefix (`s3://bucket/prefix`, `gs://…`, `az://…`,
    /// `file:///abs/dir`; written as `path` in the spec), downloaded into a local cache.
    ObjectStore { url: String },
    /// A local HF-layout directory.
    Local { path: PathBuf },
}

impl DownloadSource {
    /// The local directory, for a `path` source.
    pub fn local_path(&self) -> Option<&Path> {
        match self {
            DownloadSource::Local { path } => Some(path),
            DownloadSource::Hub { .. } | DownloadSource::ObjectStore { .. } => None,
        }
    }
}

impl StepConfig {
    pub fn kind(&self) -> StepKind {
        match self {
            StepConfig::HfDownload { .. } => StepKind::HfDownload,
            StepConfig::MegatronShard { .. } => StepKind::MegatronShard,
            StepConfig::MegatronSplitFused { .. } => StepKind::MegatronSplitFused,
            StepConfig::CheckpointValidate {} => StepKind::CheckpointValidate,
            StepConfig::CheckpointReshard { .. } => StepKind::CheckpointReshard,
            StepConfig::CheckpointExport { .. } => StepKind::CheckpointExport,
            StepConfig::StoreUpload { .. } => StepKind::StoreUpload,
            StepConfig::Command { .. } => StepKind::Command,
        }
    }

    /// The target mesh of a `megatron.shard` or `checkpoint.reshard` step.
    pub fn mesh(&self) -> Option<shardline_layout::Mesh> {
        match *self {
            StepConfig::MegatronShard { tp, cp, dp, ep, etp, .. }
            | StepConfig::CheckpointReshard { tp, cp, dp, ep, etp, .. } => {
                Some(shardline_layout::Mesh { tp, cp, dp, ep, etp })
            }
            _ => None,
        }
    }
}

/// A step with every value concrete.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ResolvedStep {
    pub id: String,
    pub kind: StepKind,
    pub needs: Vec<String>,
    pub config: StepConfig,
    pub resources: Resources,
    pub retry: Retry,
    pub timeout: Duration,
    pub cache: bool,
}

/// A pipeline instantiated for one run: params substituted, defaults filled, every value typed.
/// Stored with the run as JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedPipeline {
    pub name: String,
    /// sha256 (hex) of the canonical resolved config with `${{ run.id }}` left symbolic: equal
    /// for two submissions of the same spec with the same params, whatever their run ids.
    pub spec_hash: String,
    /// Final value of every param ([`ParamValue::to_json`]).
    pub params: BTreeMap<String, serde_json::Value>,
    /// Steps in file order.
    pub steps: Vec<ResolvedStep>,
    /// `concurrency:`, `pool:` and `priority:` (absent from older stored specs: none).
    #[serde(default, skip_serializing_if = "crate::run_limits::RunLimits::is_default")]
    pub limits: crate::run_limits::RunLimits,
    /// `retention:` (absent from older stored specs: none).
    #[serde(default, skip_serializing_if = "crate::retention::Retention::is_default")]
    pub retention: crate::retention::Retention,
}

impl ResolvedPipeline {
    pub fn step(&self, id: &str) -> Option<&ResolvedStep> {
        self.steps.iter().find(|s| s.id == id)
    }

    /// The steps in an order where every step comes after the steps it needs; among steps that
    /// are ready at the same time, file order. Deterministic. (Needs naming no step are ignored;
    /// steps on a cycle, which lint refuses, are left out.)
    pub fn topo_order(&self) -> Vec<&ResolvedStep> {
        let mut index: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, s) in self.steps.iter().enumerate() {
            index.entry(s.id.as_str()).or_insert(i);
        }
        let mut waiting = vec![0usize; self.steps.len()];
        let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); self.steps.len()];
        for (i, s) in self.steps.iter().enumerate() {
            let needs: std::collections::BTreeSet<usize> =
                s.needs.iter().filter_map(|n| index.get(n.as_str()).copied()).collect();
            waiting[i] = needs.len();
            for j in needs {
                dependents[j].push(i);
            }
        }
        let mut ready: std::collections::BTreeSet<usize> = (0..self.steps.len()).filter(|&i| waiting[i] == 0).collect();
        let mut order = Vec::with_capacity(self.steps.len());
        while let Some(i) = ready.pop_first() {
            order.push(&self.steps[i]);
            for &d in &dependents[i] {
                waiting[d] -= 1;
                if waiting[d] == 0 {
                    ready.insert(d);
                }
            }
        }
        order
    }

    /// Every step `id` transitively needs, in topological order.
    pub fn upstream(&self, id: &str) -> Vec<&ResolvedStep> {
        let mut seen: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
        let mut stack: Vec<&str> =
            self.step(id).map(|s| s.needs.iter().map(String::as_str).collect()).unwrap_or_default();
        while let Some(n) = stack.pop() {
            if seen.insert(n) {
                if let Some(s) = self.step(n) {
                    stack.extend(s.needs.iter().map(String::as_str));
                }
            }
        }
        self.topo_order().into_iter().filter(|s| seen.contains(s.id.as_str())).collect()
    }

    /// The local source release of a step: the `path` of the `hf.download` step it
    /// (transitively) needs, or its own for a download step. This is what `checkpoint.validate`
    /// compares against. `None` when the source is a Hub repository
    /// ([`ResolvedPipeline::download_source_of`]).
    pub fn source_of(&self, id: &str) -> Option<&Path> {
        self.download_source_of(id).and_then(DownloadSource::local_path)
    }

    /// The source of a step: that of the `hf.download` step it (transitively) needs, or its own.
    pub fn download_source_of(&self, id: &str) -> Option<&DownloadSource> {
        let own = self.step(id).into_iter();
        own.chain(self.upstream(id)).find_map(|s| match &s.config {
            StepConfig::HfDownload { source } => Some(source),
            _ => None,
        })
    }

    /// A cache key for one step: sha256 (hex) of its resolved config (run id included, so a
    /// step that writes under `${{ run.id }}` is never shared between runs) and of the hashes of
    /// the steps it needs. `None` for an unknown id.
    pub fn step_hash(&self, id: &str) -> Option<String> {
        self.step_hashes().remove(id)
    }

    /// [`ResolvedPipeline::step_hash`] of every step, computed once in topological order.
    pub fn step_hashes(&self) -> BTreeMap<String, String> {
        use sha2::{Digest, Sha256};
        let mut hashes: BTreeMap<String, String> = BTreeMap::new();
        for step in self.topo_order() {
            let mut h = Sha256::new();
            h.update(b"shardline/v1 step\0");
            let canonical =
                serde_json::to_vec(&(step.kind, &step.config, step.resources, step.retry, step.timeout, step.cache))
                    .unwrap_or_default();
            h.update(&canonical);
            let mut needs: Vec<&String> = step.needs.iter().collect();
            needs.sort();
            needs.dedup();
            for n in needs {
                h.update(b"\0need\0");
                h.update(n.as_bytes());
                h.update(b"=");
                h.update(hashes.get(n).map(String::as_str).unwrap_or("").as_bytes());
            }
            hashes.insert(step.id.clone(), hex::encode(h.finalize()));
        }
        hashes
    }
}

fn one() -> u64 {
    1
}
