//! The fields of every step kind, as data: name, type, default. Conversions of written values,
//! param values and interpolated text into typed values, with the messages for each failure.

use std::path::PathBuf;
use std::time::Duration;

use crate::checks::{checkpoint_url, env_name, glob, mesh_text, repo_id, revision, source_url, target, url};
use crate::model::{OutputFormatName, ParamType, ParamValue, RngPolicyName, SpecValue, StepKind};
use crate::suggest::{did_you_mean, list};
use crate::yaml::{describe_scalar, quote, Kind, Node, Resolved};
use shardline_units::{format_size, parse_duration, parse_size};

/// The type of a field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FieldType {
    UInt {
        min: u64,
        max: u64,
    },
    Bool,
    Str,
    Path,
    /// `checkpoint.reshard`'s `path`: a local checkpoint directory or an object-store prefix.
    CheckpointPath,
    /// A local directory (no URL).
    LocalPath,
    /// A mesh as assignments, `tp=2,dp=4,ep=2,etp=1`.
    Mesh,
    Choice(&'static [&'static str]),
    Size {
        min: u64,
    },
    Duration {
        positive: bool,
    },
    /// `store.upload` target: a `file://`, `s3://`, `gs://` or `az://` URL, or an absolute path.
    Target,
    /// A Hub repository id: `name` or `org/name`.
    RepoId,
    /// A Hub revision: a branch, a tag or a commit sha.
    Revision,
    /// An `http://` or `https://` base URL.
    Url,
    /// A list of `fnmatch` globs (one string counts as a list of one).
    Globs,
    /// A command's `run`: a list of arguments (one string counts as a list of one).
    Argv,
    /// A command's `env`: a mapping of environment variable names to strings.
    EnvMap,
    /// Environment variable names (one string counts as a list of one).
    EnvNames,
    /// A string that any param may fill (a value of a command's `env`).
    Text,
}

impl FieldType {
    pub fn name(self) -> String {
        match self {
            FieldType::UInt { .. } => "int".to_string(),
            FieldType::Bool => "bool".to_string(),
            FieldType::Str => "string".to_string(),
            FieldType::Path | FieldType::CheckpointPath | FieldType::LocalPath => "path".to_string(),
            FieldType::Mesh => "mesh (`tp=N,dp=N,…`)".to_string(),
            FieldType::Choice(c) => format!("one of {}", list(c)),
            FieldType::Size { .. } => "size".to_string(),
            FieldType::Duration { .. } => "duration".to_string(),
            FieldType::Target => "`file://` URL or absolute path".to_string(),
            FieldType::RepoId => "Hub repository id".to_string(),
            FieldType::Revision => "revision".to_string(),
            FieldType::Url => "URL".to_string(),
            FieldType::Globs => "glob pattern (or a list of them)".to_string(),
            FieldType::Argv => "argument string (or a list of them)".to_string(),
            FieldType::EnvMap => "mapping of environment variables".to_string(),
            FieldType::EnvNames => "environment variable name (or a list of them)".to_string(),
            FieldType::Text => "string".to_string(),
        }
    }

    /// Whether a whole-value interpolation of a param of type `ty` may fill this field.
    pub fn accepts_param(self, ty: ParamType) -> bool {
        match self {
            FieldType::UInt { .. } => ty == ParamType::Int,
            FieldType::Bool => ty == ParamType::Bool,
            FieldType::Str
            | FieldType::Path
            | FieldType::CheckpointPath
            | FieldType::LocalPath
            | FieldType::Target
            | FieldType::Choice(_) => matches!(ty, ParamType::String | ParamType::Path),
            FieldType::Mesh => ty == ParamType::String,
            FieldType::RepoId | FieldType::Revision | FieldType::Url | FieldType::Globs | FieldType::EnvNames => {
                ty == ParamType::String
            }
            // Any param reads as text in an argument or a variable (`--tp ${{ params.tp }}`).
            FieldType::Argv | FieldType::Text => true,
            FieldType::EnvMap => false,
            FieldType::Size { .. } => ty == ParamType::Size,
            FieldType::Duration { .. } => ty == ParamType::Duration,
        }
    }

    /// Whether the field may mix text and interpolations (`file:///out/${{ run.id }}`).
    pub fn accepts_text(self) -> bool {
        matches!(
            self,
            FieldType::Str
                | FieldType::Path
                | FieldType::CheckpointPath
                | FieldType::LocalPath
                | FieldType::Mesh
                | FieldType::Target
                | FieldType::RepoId
                | FieldType::Revision
                | FieldType::Url
                | FieldType::Globs
                | FieldType::Argv
                | FieldType::EnvNames
                | FieldType::Text
        )
    }
}

/// A field's default.
#[derive(Clone, Copy, Debug)]
pub(crate) enum FieldDefault {
    Required,
    /// No value unless written (`with.repo` and `with.path` of `hf.download`: one of them is).
    Optional,
    /// An empty list.
    EmptyList,
    UInt(u64),
    Bool(bool),
    Str(&'static str),
    Size(u64),
    DurationSecs(u64),
    /// The value of another `with` field of the same step (`etp` defaults to `tp`).
    SameAs(&'static str),
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Field {
    pub name: &'static str,
    pub ty: FieldType,
    pub default: FieldDefault,
}

const fn field(name: &'static str, ty: FieldType, default: FieldDefault) -> Field {
    Field { name, ty, default }
}

const POSITIVE: FieldType = FieldType::UInt { min: 1, max: 1 << 20 };
const U32_POSITIVE: FieldType = FieldType::UInt { min: 1, max: u32::MAX as u64 };
const U32: FieldType = FieldType::UInt { min: 0, max: u32::MAX as u64 };

/// Exactly one of `repo` and `path` is written (lint checks it); the others go with `repo`.
/// The spellings of `torchtitan_version`: `TorchtitanVersion::NAMES`' (a test keeps them equal).
const TORCHTITAN_VERSIONS: &[&str] = &[
    "main",
    "0.3.0",
    "2026-07-16",
    "3101b42f9",
    "2026-05-27",
    "200100e7d",
    "2026-04-27",
    "786e26f8e",
    "2026-04-16",
    "ad7a86533",
    "2025-12",
    "0.2.2",
];

const HF_DOWNLOAD: &[Field] = &[
    field("repo", FieldType::RepoId, FieldDefault::Optional),
    field("path", FieldType::Path, FieldDefault::Optional),
    field("revision", FieldType::Revision, FieldDefault::Str("main")),
    field("allow", FieldType::Globs, FieldDefault::EmptyList),
    field("ignore", FieldType::Globs, FieldDefault::EmptyList),
    field("endpoint", FieldType::Url, FieldDefault::Optional),
];

/// The `hf.download` fields that only a Hub download (`repo`) takes.
pub(crate) const HUB_ONLY_FIELDS: &[&str] = &["revision", "allow", "ignore", "endpoint"];

const MEGATRON_SHARD: &[Field] = &[
    field("tp", POSITIVE, FieldDefault::Required),
    field("cp", POSITIVE, FieldDefault::UInt(1)),
    field("dp", POSITIVE, FieldDefault::Required),
    field("ep", POSITIVE, FieldDefault::UInt(1)),
    field("etp", POSITIVE, FieldDefault::SameAs("tp")),
    field("format", FieldType::Choice(OutputFormatName::NAMES), FieldDefault::Str("dcp")),
    field(
        "target",
        FieldType::Choice(&["fsdp_dtensor", "torch_dist", "torchtitan"]),
        FieldDefault::Str("fsdp_dtensor"),
    ),
    // With `target: torchtitan`: whose names the seed is written with (`convert --torchtitan-version`).
    field("torchtitan_version", FieldType::Choice(TORCHTITAN_VERSIONS), FieldDefault::Optional),
    // `model.module.` for fsdp_dtensor, none for torch_dist and torchtitan.
    field("prefix", FieldType::Str, FieldDefault::Optional),
    field("optimizer_state", FieldType::Bool, FieldDefault::Bool(false)),
    field("vocab_divisible_by", POSITIVE, FieldDefault::UInt(128)),
    field("keep", FieldType::Bool, FieldDefault::Bool(false)),
];

const MEGATRON_SPLIT_FUSED: &[Field] = &[field("keep", FieldType::Bool, FieldDefault::Bool(false))];

const CHECKPOINT_VALIDATE: &[Field] = &[];

/// The source is `path`, else the checkpoint of the step it needs (lint checks one of them).
const CHECKPOINT_RESHARD: &[Field] = &[
    field("path", FieldType::CheckpointPath, FieldDefault::Optional),
    field("tp", POSITIVE, FieldDefault::Required),
    field("cp", POSITIVE, FieldDefault::UInt(1)),
    field("dp", POSITIVE, FieldDefault::Required),
    field("ep", POSITIVE, FieldDefault::UInt(1)),
    field("etp", POSITIVE, FieldDefault::SameAs("tp")),
    field("rng", FieldType::Choice(RngPolicyName::NAMES), FieldDefault::Str("from-rank0")),
    field("vocab_size", FieldType::UInt { min: 1, max: 1 << 40 }, FieldDefault::Optional),
    field("from_mesh", FieldType::Mesh, FieldDefault::Optional),
    // `fsdp_dtensor` translates a torch_dist source; absent, the source's dialect is kept.
    field("target", FieldType::Choice(&["fsdp_dtensor", "torch_dist"]), FieldDefault::Optional),
];

/// HF's default `max_shard_size`.
pub(crate) const DEFAULT_MAX_FILE_SIZE: u64 = 5_000_000_000;

const CHECKPOINT_EXPORT: &[Field] = &[
    field("like", FieldType::LocalPath, FieldDefault::Optional),
    field("etp", POSITIVE, FieldDefault::Optional),
    field("max_file_size", FieldType::Size { min: 1 }, FieldDefault::Size(DEFAULT_MAX_FILE_SIZE)),
    // Tasks the weight files are written by (file i by part i mod parts), then one that commits.
    field("parts", POSITIVE, FieldDefault::UInt(1)),
];

const STORE_UPLOAD: &[Field] = &[field("to", FieldType::Target, FieldDefault::Required)];

/// `run` is an argv unless `shell` (then one script); `env` adds to a minimal environment, as
/// `inherit` does with the worker's own variables; `workdir` defaults to the submitting directory.
const COMMAND: &[Field] = &[
    field("run", FieldType::Argv, FieldDefault::Required),
    field("shell", FieldType::Bool, FieldDefault::Bool(false)),
    field("env", FieldType::EnvMap, FieldDefault::Optional),
    field("inherit", FieldType::EnvNames, FieldDefault::EmptyList),
    field("workdir", FieldType::LocalPath, FieldDefault::Optional),
];

/// The `with` fields of a step kind.
pub(crate) fn with_fields(kind: StepKind) -> &'static [Field] {
    match kind {
        StepKind::HfDownload => HF_DOWNLOAD,
        StepKind::MegatronShard => MEGATRON_SHARD,
        StepKind::MegatronSplitFused => MEGATRON_SPLIT_FUSED,
        StepKind::CheckpointValidate => CHECKPOINT_VALIDATE,
        StepKind::CheckpointReshard => CHECKPOINT_RESHARD,
        StepKind::CheckpointExport => CHECKPOINT_EXPORT,
        StepKind::StoreUpload => STORE_UPLOAD,
        StepKind::Command => COMMAND,
    }
}

pub(crate) const RESOURCES: &[Field] = &[
    field("cpus", U32_POSITIVE, FieldDefault::UInt(1)),
    field("memory", FieldType::Size { min: 1 }, FieldDefault::Size(1 << 30)),
    field("gpus", U32, FieldDefault::UInt(0)),
    field("scratch", FieldType::Size { min: 0 }, FieldDefault::Size(0)),
];

pub(crate) const RETRY: &[Field] = &[
    field("attempts", U32_POSITIVE, FieldDefault::UInt(3)),
    field("lost", U32_POSITIVE, FieldDefault::UInt(crate::model::DEFAULT_LOST as u64)),
    field("backoff", FieldType::Duration { positive: false }, FieldDefault::DurationSecs(5)),
];

pub(crate) const TIMEOUT: Field =
    field("timeout", FieldType::Duration { positive: true }, FieldDefault::DurationSecs(6 * 3600));
pub(crate) const CACHE: Field = field("cache", FieldType::Bool, FieldDefault::Bool(true));

/// Keys of a step mapping.
pub(crate) const STEP_KEYS: &[&str] = &["id", "uses", "needs", "with", "resources", "retry", "timeout", "cache"];
/// Keys of the top-level mapping.
pub(crate) const TOP_KEYS: &[&str] = &[
    "apiVersion",
    "kind",
    "name",
    "description",
    "params",
    "steps",
    "triggers",
    "notify",
    "concurrency",
    "pool",
    "priority",
    "retention",
];
/// Keys of `concurrency:` written as a mapping.
pub(crate) const CONCURRENCY_KEYS: &[&str] = &["limit", "overflow"];
/// Keys of `retention:`.
pub(crate) const RETENTION_KEYS: &[&str] = &["runs"];
/// Keys of a param declaration.
pub(crate) const PARAM_KEYS: &[&str] = &["type", "default", "enum", "description"];

/// A hint for a `with` key a kind does not have.
pub(crate) fn unknown_with_hint(kind: StepKind, key: &str) -> String {
    let fields: Vec<&str> = with_fields(kind).iter().map(|f| f.name).collect();
    if let Some(s) = did_you_mean(key, fields.iter().copied()) {
        return format!("did you mean `{s}`?");
    }
    match (kind, key) {
        (StepKind::HfDownload, "token" | "hf_token") => {
            "the Hub token is never written in a spec: it comes from `HF_TOKEN` or the token file \
             (`HF_TOKEN_PATH`, default `$HF_HOME/token`)"
                .to_string()
        }
        (StepKind::HfDownload, "repo_id" | "model" | "model_id" | "name") => "did you mean `repo`?".to_string(),
        (StepKind::HfDownload, "allow_patterns" | "include") => "did you mean `allow`?".to_string(),
        (StepKind::HfDownload, "ignore_patterns" | "exclude") => "did you mean `ignore`?".to_string(),
        (StepKind::HfDownload, "branch" | "tag" | "sha" | "commit" | "ref") => "did you mean `revision`?".to_string(),
        (StepKind::HfDownload, "url" | "uri" | "source" | "from") => {
            "a download reads `repo` (a Hub repository id such as `Qwen/Qwen3-0.6B`) or `path` (a local \
             directory)"
                .to_string()
        }
        (StepKind::CheckpointValidate, "against") => {
            "`checkpoint.validate` always compares against the source of the upstream `hf.download` step; \
             it takes no `with` fields"
                .to_string()
        }
        (StepKind::CheckpointValidate, _) => "`checkpoint.validate` takes no `with` fields".to_string(),
        (StepKind::CheckpointReshard, "to" | "out" | "output") => {
            "a step's output directory is chosen by the run; upload it with a `store.upload` step".to_string()
        }
        (StepKind::CheckpointReshard, "source" | "from" | "ckpt" | "checkpoint") => {
            "did you mean `path`? (without it, the step reads the checkpoint of the step it needs)".to_string()
        }
        (StepKind::CheckpointExport, "release" | "hf" | "against" | "reference") => "did you mean `like`?".to_string(),
        (StepKind::Command, "cmd" | "command" | "args" | "argv" | "script" | "exec") => {
            "did you mean `run`? (a list of arguments, or one script with `shell: true`)".to_string()
        }
        (StepKind::Command, "environment" | "vars" | "variables") => "did you mean `env`?".to_string(),
        (StepKind::Command, "cwd" | "dir" | "directory" | "working_directory") => "did you mean `workdir`?".to_string(),
        (StepKind::Command, "outputs" | "output" | "out" | "result") => {
            "a command writes its outputs into `$SHARDLINE_OUTPUT_DIR`; a `result.json` there (a JSON object of at \
             most 64 KiB) is recorded as its result"
                .to_string()
        }
        _ => format!("`{kind}` takes {}", list(&fields)),
    }
}

/// A typed value of a field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Concrete {
    UInt(u64),
    Bool(bool),
    Str(String),
    List(Vec<String>),
    /// A command's `env`.
    Map(std::collections::BTreeMap<String, String>),
    Size(u64),
    Duration(Duration),
}

impl Concrete {
    pub fn from_default(d: FieldDefault) -> Option<Concrete> {
        Some(match d {
            FieldDefault::Required | FieldDefault::Optional | FieldDefault::SameAs(_) => return None,
            FieldDefault::EmptyList => Concrete::List(Vec::new()),
            FieldDefault::UInt(n) => Concrete::UInt(n),
            FieldDefault::Bool(b) => Concrete::Bool(b),
            FieldDefault::Str(s) => Concrete::Str(s.to_string()),
            FieldDefault::Size(n) => Concrete::Size(n),
            FieldDefault::DurationSecs(s) => Concrete::Duration(Duration::from_secs(s)),
        })
    }
}

/// Why a value does not fit its field: a message (without the field name) and a hint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Mismatch {
    pub code: &'static str,
    pub message: String,
    pub hint: Option<String>,
}

fn mismatch(message: String, hint: Option<String>) -> Mismatch {
    Mismatch { code: "wrong-type", message, hint }
}

pub(crate) fn invalid(message: String, hint: Option<String>) -> Mismatch {
    Mismatch { code: "invalid-value", message, hint }
}

fn expected(ty: FieldType, found: &str) -> Mismatch {
    mismatch(format!("expected {}, found {found}", ty.name()), None)
}

/// Reads a YAML node written for a field into a [`SpecValue`] (nothing else is representable).
pub(crate) fn spec_value(ty: FieldType, node: &Node) -> Result<SpecValue, Mismatch> {
    let Kind::Scalar(s) = &node.kind else {
        return Err(expected(ty, &node.describe()));
    };
    match s.resolve() {
        Resolved::Bool(b) => Ok(SpecValue::Bool(b)),
        Resolved::Int(i) => Ok(SpecValue::Int(i)),
        Resolved::Str(t) => Ok(SpecValue::String(t.to_string())),
        Resolved::Float(f) if matches!(ty, FieldType::UInt { .. }) => {
            Err(mismatch(format!("expected int, found float {f}"), Some("counts are whole numbers".to_string())))
        }
        Resolved::Float(_) if matches!(ty, FieldType::Size { .. }) => Err(mismatch(
            format!("expected size, found {}", describe_scalar(&s.resolve())),
            Some("use a whole number and a smaller unit, e.g. `1536MiB` rather than `1.5GiB`".to_string()),
        )),
        Resolved::Float(_)
            if matches!(
                ty,
                FieldType::Str
                    | FieldType::Path
                    | FieldType::CheckpointPath
                    | FieldType::LocalPath
                    | FieldType::Mesh
                    | FieldType::Revision
                    | FieldType::Globs
                    | FieldType::Argv
                    | FieldType::Text
            ) =>
        {
            Err(expected(ty, &describe_scalar(&s.resolve()))
                .with_hint(format!("quote it to make it a string: `\"{}\"`", s.text)))
        }
        Resolved::BigInt if matches!(ty, FieldType::UInt { .. } | FieldType::Size { .. }) => {
            Err(invalid(format!("`{}` is out of range", s.text), None))
        }
        other => Err(expected(ty, &describe_scalar(&other))),
    }
}

impl Mismatch {
    fn with_hint(mut self, hint: String) -> Mismatch {
        self.hint = Some(hint);
        self
    }
}

/// Converts a literal [`SpecValue`] (no interpolation) into the field's type.
pub(crate) fn convert_literal(ty: FieldType, v: &SpecValue) -> Result<Concrete, Mismatch> {
    match (ty, v) {
        (_, SpecValue::Template(t)) => Err(mismatch(format!("unexpected interpolation `{}`", t.source()), None)),
        (FieldType::UInt { min, max }, SpecValue::Int(i)) => uint(*i, min, max),
        (FieldType::UInt { .. }, SpecValue::String(s)) => {
            let hint = s.trim().parse::<i64>().is_ok().then(|| format!("remove the quotes: `{}`", s.trim()));
            Err(Mismatch { hint, ..expected(ty, &format!("string {}", quote(s))) })
        }
        (FieldType::Bool, SpecValue::Bool(b)) => Ok(Concrete::Bool(*b)),
        (FieldType::Bool, SpecValue::String(s)) => {
            let hint = match s.as_str() {
                "yes" | "no" | "on" | "off" | "y" | "n" | "Yes" | "No" | "On" | "Off" => {
                    Some("YAML 1.2 booleans are `true` and `false`".to_string())
                }
                "true" | "false" => Some(format!("remove the quotes: `{s}`")),
                _ => None,
            };
            Err(Mismatch { hint, ..expected(ty, &format!("string {}", quote(s))) })
        }
        (FieldType::Size { .. }, SpecValue::Int(i)) if *i >= 0 => size(u64::try_from(*i).unwrap_or(0), ty),
        (FieldType::Duration { .. }, SpecValue::Int(i)) => Err(mismatch(
            format!("expected duration, found int {i}"),
            Some(format!("add a unit, e.g. `{i}s`, `{i}m` or `{i}h`")),
        )),
        (
            FieldType::Str
            | FieldType::Path
            | FieldType::CheckpointPath
            | FieldType::LocalPath
            | FieldType::Mesh
            | FieldType::Target
            | FieldType::Choice(_)
            | FieldType::RepoId
            | FieldType::Revision
            | FieldType::Url
            | FieldType::Globs
            | FieldType::Argv
            | FieldType::EnvMap
            | FieldType::EnvNames
            | FieldType::Text,
            SpecValue::Int(_) | SpecValue::Bool(_),
        ) => {
            let (found, text) = match v {
                SpecValue::Int(i) => (format!("int {i}"), i.to_string()),
                SpecValue::Bool(b) => (format!("bool {b}"), b.to_string()),
                _ => (String::new(), String::new()),
            };
            let hint =
                (!matches!(ty, FieldType::Choice(_))).then(|| format!("quote it to make it a string: `\"{text}\"`"));
            Err(Mismatch { hint, ..expected(ty, &found) })
        }
        (_, SpecValue::String(s)) => convert_text(ty, s),
        (_, SpecValue::List(_)) => Err(expected(ty, "a sequence")),
        (_, SpecValue::Map(_)) => Err(expected(ty, "a mapping")),
        (_, SpecValue::Int(i)) => Err(expected(ty, &format!("int {i}"))),
        (_, SpecValue::Bool(b)) => Err(expected(ty, &format!("bool {b}"))),
    }
}

fn uint(i: i64, min: u64, max: u64) -> Result<Concrete, Mismatch> {
    match u64::try_from(i) {
        Ok(n) if n >= min && n <= max => Ok(Concrete::UInt(n)),
        Ok(n) if n > max => Err(invalid(format!("must be at most {max}, found {n}"), None)),
        _ => Err(invalid(format!("must be at least {min}, found {i}"), None)),
    }
}

fn size(n: u64, ty: FieldType) -> Result<Concrete, Mismatch> {
    match ty {
        FieldType::Size { min } if n < min => {
            Err(invalid(format!("must be at least {}, found {}", format_size(min), format_size(n)), None))
        }
        _ => Ok(Concrete::Size(n)),
    }
}

/// Converts text (a literal string, or an interpolation's result) into the field's type.
pub(crate) fn convert_text(ty: FieldType, s: &str) -> Result<Concrete, Mismatch> {
    match ty {
        FieldType::UInt { min, max } => match s.trim().parse::<i64>() {
            Ok(i) => uint(i, min, max),
            Err(_) => Err(expected(ty, &format!("string {}", quote(s)))),
        },
        FieldType::Bool => match s.trim() {
            "true" => Ok(Concrete::Bool(true)),
            "false" => Ok(Concrete::Bool(false)),
            _ => Err(expected(ty, &format!("string {}", quote(s)))),
        },
        FieldType::Str => Ok(Concrete::Str(s.to_string())),
        FieldType::Path => {
            if s.trim().is_empty() {
                Err(invalid("path is empty".to_string(), None))
            } else if let Some((scheme, rest)) = s.split_once("://") {
                source_url(s, scheme, rest).map(|()| Concrete::Str(s.to_string()))
            } else {
                Ok(Concrete::Str(s.to_string()))
            }
        }
        FieldType::CheckpointPath => {
            if s.trim().is_empty() {
                Err(invalid("path is empty".to_string(), None))
            } else if let Some((scheme, rest)) = s.split_once("://") {
                checkpoint_url(s, scheme, rest).map(|()| Concrete::Str(s.to_string()))
            } else {
                Ok(Concrete::Str(s.to_string()))
            }
        }
        FieldType::LocalPath => {
            if s.trim().is_empty() {
                Err(invalid("path is empty".to_string(), None))
            } else if let Some((scheme, _)) = s.split_once("://") {
                Err(invalid(
                    format!("expected a local directory, found a `{scheme}://` URL"),
                    Some(
                        "give the path of a local HF release directory (config.json, safetensors headers)".to_string(),
                    ),
                ))
            } else {
                Ok(Concrete::Str(s.to_string()))
            }
        }
        FieldType::Mesh => mesh_text(s).map(Concrete::Str),
        FieldType::RepoId => repo_id(s).map(|()| Concrete::Str(s.to_string())),
        FieldType::Revision => revision(s).map(|()| Concrete::Str(s.to_string())),
        FieldType::Url => url(s).map(|()| Concrete::Str(s.trim_end_matches('/').to_string())),
        FieldType::Globs => glob(s).map(|()| Concrete::List(vec![s.to_string()])),
        FieldType::Choice(choices) => {
            if choices.contains(&s) {
                Ok(Concrete::Str(s.to_string()))
            } else {
                let hint = match did_you_mean(s, choices.iter().copied()) {
                    Some(c) => format!("did you mean `{c}`?"),
                    None => format!("use one of {}", list(choices)),
                };
                Err(invalid(format!("expected one of {}, found {}", list(choices), quote(s)), Some(hint)))
            }
        }
        FieldType::Size { .. } => match parse_size(s) {
            Ok(n) => size(n, ty),
            Err(e) => Err(invalid(format!("invalid size {}: {e}", quote(s)), Some(e.hint(true)))),
        },
        FieldType::Duration { positive } => match parse_duration(s) {
            Ok(d) if positive && d.is_zero() => Err(invalid("must be longer than 0s".to_string(), None)),
            Ok(d) => Ok(Concrete::Duration(d)),
            Err(e) => Err(invalid(format!("invalid duration {}: {e}", quote(s)), Some(e.hint(false)))),
        },
        FieldType::Target => target(s).map(|()| Concrete::Str(s.to_string())),
        FieldType::Argv => Ok(Concrete::List(vec![s.to_string()])),
        FieldType::Text => Ok(Concrete::Str(s.to_string())),
        FieldType::EnvNames => env_name(s).map(|()| Concrete::List(vec![s.to_string()])),
        FieldType::EnvMap => Err(expected(ty, &format!("string {}", quote(s)))),
    }
}

/// Converts a param's value (a whole-value interpolation) into the field's type.
pub(crate) fn convert_param(ty: FieldType, v: &ParamValue) -> Result<Concrete, Mismatch> {
    match (ty, v) {
        (FieldType::Argv, _) => Ok(Concrete::List(vec![v.to_string()])),
        (FieldType::Text, _) => Ok(Concrete::Str(v.to_string())),
        (FieldType::UInt { min, max }, ParamValue::Int(i)) => uint(*i, min, max),
        (FieldType::Bool, ParamValue::Bool(b)) => Ok(Concrete::Bool(*b)),
        (FieldType::Size { .. }, ParamValue::Size(n)) => size(*n, ty),
        (FieldType::Duration { positive }, ParamValue::Duration(d)) => {
            if positive && d.is_zero() {
                Err(invalid("must be longer than 0s".to_string(), None))
            } else {
                Ok(Concrete::Duration(*d))
            }
        }
        (_, ParamValue::String(_) | ParamValue::Path(_)) if ty.accepts_param(v.ty()) => {
            convert_text(ty, &v.to_string())
        }
        _ => Err(mismatch(format!("expected {}, found {} param", ty.name(), v.ty()), None)),
    }
}

/// Reads a param value (a default or an `enum` entry) from YAML.
pub(crate) fn param_from_node(ty: ParamType, node: &Node) -> Result<ParamValue, Mismatch> {
    let Kind::Scalar(s) = &node.kind else {
        return Err(mismatch(format!("expected {ty}, found {}", node.describe()), None));
    };
    let r = s.resolve();
    match (ty, &r) {
        (ParamType::Int, Resolved::Int(i)) => Ok(ParamValue::Int(*i)),
        (ParamType::Bool, Resolved::Bool(b)) => Ok(ParamValue::Bool(*b)),
        (ParamType::Size, Resolved::Int(i)) if *i >= 0 => Ok(ParamValue::Size(u64::try_from(*i).unwrap_or(0))),
        (ParamType::Duration, Resolved::Int(i)) => {
            Err(mismatch(format!("expected duration, found int {i}"), Some(format!("add a unit, e.g. `{i}s`"))))
        }
        (ParamType::String | ParamType::Path | ParamType::Size | ParamType::Duration, Resolved::Str(t)) => {
            param_from_text(ty, t)
        }
        (ParamType::String | ParamType::Path, Resolved::Int(_) | Resolved::Bool(_) | Resolved::Float(_)) => {
            Err(mismatch(
                format!("expected {ty}, found {}", describe_scalar(&r)),
                Some(format!("quote it to make it a string: `\"{}\"`", s.text)),
            ))
        }
        (ParamType::Bool, Resolved::Str(t @ ("true" | "false"))) => Err(mismatch(
            format!("expected bool, found string {}", quote(t)),
            Some(format!("remove the quotes: `{t}`")),
        )),
        (ParamType::Int, Resolved::Str(t)) if t.trim().parse::<i64>().is_ok() => Err(mismatch(
            format!("expected int, found string {}", quote(t)),
            Some(format!("remove the quotes: `{}`", t.trim())),
        )),
        _ => Err(mismatch(format!("expected {ty}, found {}", describe_scalar(&r)), None)),
    }
}

/// Reads a param value from text (`--set NAME=TEXT`, or a YAML string).
pub(crate) fn param_from_text(ty: ParamType, t: &str) -> Result<ParamValue, Mismatch> {
    match ty {
        ParamType::String => Ok(ParamValue::String(t.to_string())),
        ParamType::Path if t.trim().is_empty() => Err(invalid("path is empty".to_string(), None)),
        ParamType::Path => Ok(ParamValue::Path(PathBuf::from(t))),
        ParamType::Int => t
            .trim()
            .parse::<i64>()
            .map(ParamValue::Int)
            .map_err(|_| mismatch(format!("expected int, found {}", quote(t)), None)),
        ParamType::Bool => match t.trim() {
            "true" => Ok(ParamValue::Bool(true)),
            "false" => Ok(ParamValue::Bool(false)),
            _ => Err(mismatch(
                format!("expected bool, found {}", quote(t)),
                Some("booleans are `true` and `false`".to_string()),
            )),
        },
        ParamType::Size => parse_size(t)
            .map(ParamValue::Size)
            .map_err(|e| invalid(format!("invalid size {}: {e}", quote(t)), Some(e.hint(true)))),
        ParamType::Duration => parse_duration(t)
            .map(ParamValue::Duration)
            .map_err(|e| invalid(format!("invalid duration {}: {e}", quote(t)), Some(e.hint(false)))),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn torchtitan_versions_are_the_planners() {
        let planner: Vec<&str> = shardline_layout::TorchtitanVersion::NAMES.iter().map(|(n, _)| *n).collect();
        assert_eq!(super::TORCHTITAN_VERSIONS, planner.as_slice());
    }
}
