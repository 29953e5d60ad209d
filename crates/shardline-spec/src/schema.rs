//! The fields of every step kind, as data: name, type, default. Conversions of written values,
//! param values and interpolated text into typed values, with the messages for each failure.

use std::path::PathBuf;
use std::time::Duration;

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
            FieldType::RepoId | FieldType::Revision | FieldType::Url | FieldType::Globs => ty == ParamType::String,
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
    field("prefix", FieldType::Str, FieldDefault::Str("model.module.")),
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
];

/// HF's default `max_shard_size`.
pub(crate) const DEFAULT_MAX_FILE_SIZE: u64 = 5_000_000_000;

const CHECKPOINT_EXPORT: &[Field] = &[
    field("like", FieldType::LocalPath, FieldDefault::Optional),
    field("etp", POSITIVE, FieldDefault::Optional),
    field("max_file_size", FieldType::Size { min: 1 }, FieldDefault::Size(DEFAULT_MAX_FILE_SIZE)),
];

const STORE_UPLOAD: &[Field] = &[field("to", FieldType::Target, FieldDefault::Required)];

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
];
/// Keys of `concurrency:` written as a mapping.
pub(crate) const CONCURRENCY_KEYS: &[&str] = &["limit", "overflow"];
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

fn invalid(message: String, hint: Option<String>) -> Mismatch {
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
            | FieldType::Globs,
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
    }
}

fn target(s: &str) -> Result<(), Mismatch> {
    if let Some(rest) = s.strip_prefix("file://") {
        return if rest.is_empty() { Err(invalid("`file://` URL has no path".to_string(), None)) } else { Ok(()) };
    }
    if s.starts_with('/') {
        return Ok(());
    }
    if let Some((scheme, rest)) = s.split_once("://") {
        if OBJECT_STORE_SCHEMES.contains(&scheme) {
            return if rest.is_empty() || rest.starts_with('/') {
                Err(invalid(format!("`{scheme}://` URL has no bucket"), None))
            } else {
                Ok(())
            };
        }
        return Err(invalid(
            format!("unsupported upload target scheme `{scheme}`"),
            Some("use `file://`, `s3://`, `gs://` or `az://` URLs, or an absolute path".to_string()),
        ));
    }
    Err(invalid(
        format!("expected a `file://` URL or an absolute path, found {}", quote(s)),
        Some(format!("write `file://{s}` for a directory relative to the working directory")),
    ))
}

/// The object-store schemes a source `path` and an upload target may use (as the publish crate
/// opens them: object_store configured from the environment).
pub(crate) const OBJECT_STORE_SCHEMES: &[&str] = &["s3", "gs", "az"];

/// Whether a source `path` names an object-store prefix (`s3://`, `gs://`, `az://`, `file://`)
/// rather than a local directory read in place.
pub fn is_object_store_source(path: &str) -> bool {
    path.split_once("://").is_some_and(|(scheme, _)| scheme == "file" || OBJECT_STORE_SCHEMES.contains(&scheme))
}

/// A URL as an `hf.download` `path`: an object-store prefix (`s3://bucket/prefix`, `gs://…`,
/// `az://…`, `file:///abs/dir`) is a source; anything else (`https://huggingface.co/org/name`,
/// `ftp://…`) is reported with the way to write it.
fn source_url(s: &str, scheme: &str, rest: &str) -> Result<(), Mismatch> {
    if OBJECT_STORE_SCHEMES.contains(&scheme) {
        let bucket = rest.split('/').next().unwrap_or_default();
        return if bucket.is_empty() {
            Err(invalid(
                format!("`{scheme}://` URL has no bucket"),
                Some(format!("write `{scheme}://BUCKET/PREFIX`, the prefix the release's objects are under")),
            ))
        } else if rest.contains(char::is_whitespace) {
            Err(invalid(format!("object-store URL {} contains whitespace", quote(s)), None))
        } else {
            Ok(())
        };
    }
    if scheme == "file" {
        return if rest.starts_with('/') && rest.len() > 1 {
            Ok(())
        } else {
            Err(invalid(
                format!("`file://` source URL {} has no absolute path", quote(s)),
                Some(format!(
                    "write `file:///absolute/dir`, or `path: {}` to read a local directory in place",
                    if rest.is_empty() { "DIR" } else { rest }
                )),
            ))
        };
    }
    let hub = ["huggingface.co/", "hf.co/"].iter().find_map(|h| rest.strip_prefix(h));
    let hint = match hub.map(|r| r.split('/').take(2).collect::<Vec<_>>()) {
        Some(parts) if parts.len() == 2 && !parts[1].is_empty() => {
            format!("to download from the Hub, write `repo: {}/{}` instead of `path`", parts[0], parts[1])
        }
        _ => "use a local directory, an `s3://`, `gs://`, `az://` or `file:///` URL, or download from the Hub \
              with `repo: org/name`"
            .to_string(),
    };
    Err(invalid(
        format!(
            "`hf.download` reads a local directory or an object-store prefix (`path`), or a Hub repository \
             (`repo`); `{scheme}://` sources are not supported"
        ),
        Some(hint),
    ))
}

/// A `checkpoint.reshard` `path` URL: an object-store prefix; any other scheme is refused.
fn checkpoint_url(s: &str, scheme: &str, rest: &str) -> Result<(), Mismatch> {
    if OBJECT_STORE_SCHEMES.contains(&scheme) || scheme == "file" {
        return source_url(s, scheme, rest);
    }
    Err(invalid(
        format!("`checkpoint.reshard` reads a local checkpoint directory or an object-store prefix; `{scheme}://` is not supported"),
        Some("use a local directory or an `s3://`, `gs://`, `az://` or `file:///` URL".to_string()),
    ))
}

/// A mesh as assignments, checked on its own ([`shardline_layout::Mesh::check`]); its canonical
/// spelling (every dimension written).
fn mesh_text(s: &str) -> Result<String, Mismatch> {
    let mesh = shardline_layout::Mesh::parse_assignments(s).map_err(|e| {
        invalid(
            format!("invalid mesh {}: {e}", quote(s)),
            Some("write the source mesh as `tp=2,dp=4` (cp, ep default to 1, etp to tp)".to_string()),
        )
    })?;
    if let Some(e) = mesh.check().first() {
        return Err(invalid(format!("invalid mesh {}: {e}", quote(s)), None));
    }
    Ok(mesh.assignments())
}

/// The Hub's repository id shape: one or two segments of letters, digits, `-`, `_` and `.`, no
/// `--` at either end of a segment, no `..` (as `shardline-hub` checks it).
fn repo_id(s: &str) -> Result<(), Mismatch> {
    let segs: Vec<&str> = s.split('/').collect();
    let ok_seg = |seg: &str| {
        !seg.is_empty()
            && seg.len() <= 96
            && seg.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && !seg.starts_with("--")
            && !seg.ends_with("--")
            && !seg.contains("..")
            && seg != "."
    };
    if (segs.len() == 1 || segs.len() == 2) && segs.iter().all(|s| ok_seg(s)) {
        return Ok(());
    }
    let hint = match s.split_once("huggingface.co/").or_else(|| s.split_once("hf.co/")) {
        Some((_, rest)) => {
            let id: Vec<&str> = rest.split('/').take(2).collect();
            format!("write the repository id only: `repo: {}`", id.join("/"))
        }
        None if segs.len() > 2 => "a repository id has at most one `/`: `org/name`".to_string(),
        None => "a repository id is `name` or `org/name` of letters, digits, `-`, `_` and `.`".to_string(),
    };
    Err(invalid(format!("invalid Hub repository id {}", quote(s)), Some(hint)))
}

/// A branch, tag, `refs/pr/N` or commit sha, usable as a `refs/` path of the HF cache.
fn revision(s: &str) -> Result<(), Mismatch> {
    let bad = s.is_empty()
        || s.starts_with('/')
        || s.ends_with('/')
        || s.split('/').any(|c| c.is_empty() || c == "." || c == "..")
        || s.chars().any(|c| c.is_control() || c.is_whitespace() || c == '\\');
    if bad {
        Err(invalid(
            format!("invalid revision {}", quote(s)),
            Some("a revision is a branch (`main`), a tag (`v1.0`) or a 40-hex commit sha".to_string()),
        ))
    } else {
        Ok(())
    }
}

fn url(s: &str) -> Result<(), Mismatch> {
    let rest = s.strip_prefix("https://").or_else(|| s.strip_prefix("http://"));
    match rest {
        Some(r) if !r.is_empty() && !r.starts_with('/') && !r.contains(char::is_whitespace) => Ok(()),
        Some(_) => Err(invalid(format!("URL {} has no host", quote(s)), None)),
        None => Err(invalid(
            format!("expected an `http://` or `https://` URL, found {}", quote(s)),
            Some("e.g. `endpoint: https://huggingface.co` (the default is `HF_ENDPOINT`, else that)".to_string()),
        )),
    }
}

/// A pattern as the Hub client matches it (`fnmatch`: `*` crosses `/`; a trailing `/` means the
/// whole folder).
fn glob(s: &str) -> Result<(), Mismatch> {
    if s.is_empty() {
        return Err(invalid("empty pattern".to_string(), Some("e.g. `*.safetensors`".to_string())));
    }
    let pat = if s.ends_with('/') { format!("{s}*") } else { s.to_string() };
    globset::GlobBuilder::new(&pat).literal_separator(false).backslash_escape(true).build().map(|_| ()).map_err(|e| {
        invalid(
            format!("invalid pattern {}: {}", quote(s), e.kind()),
            Some("patterns are `fnmatch` globs: `*`, `?`, `[abc]`, e.g. `*.safetensors`".to_string()),
        )
    })
}

/// Converts a param's value (a whole-value interpolation) into the field's type.
pub(crate) fn convert_param(ty: FieldType, v: &ParamValue) -> Result<Concrete, Mismatch> {
    match (ty, v) {
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
