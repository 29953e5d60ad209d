//! Wire types of a run page's outcome (its result and timeline) and of the submit page's
//! params form, beside the others in `dto` (re-exported there).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::redact::redact_line;

/// A param a pipeline declares: what a form of its params needs.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ParamDto {
    pub name: String,
    /// `string`, `int`, `bool`, `path`, `size` or `duration`.
    #[serde(rename = "type")]
    pub ty: String,
    /// The default in its canonical spelling (secrets redacted); absent when it must be set.
    pub default: Option<String>,
    /// The allowed values (`enum:`); empty when any value of the type is allowed.
    pub choices: Vec<String>,
    pub description: Option<String>,
}

impl From<&shardline_spec::ParamSpec> for ParamDto {
    fn from(p: &shardline_spec::ParamSpec) -> ParamDto {
        ParamDto {
            name: p.name.clone(),
            ty: p.ty.as_str().into(),
            default: p.default.as_ref().map(|v| redact_line(&v.to_string())),
            choices: p.choices.iter().map(|v| redact_line(&v.to_string())).collect(),
            description: p.description.as_deref().map(redact_line),
        }
    }
}

/// Where a run's result went.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ResultDto {
    /// The step that published (an upload) or wrote it (a checkpoint, without an upload).
    pub step: String,
    /// The destination URL or path (an upload's `to:`), or the checkpoint's directory.
    pub dest: Option<String>,
    /// The published manifest (uploads).
    pub manifest: Option<String>,
    /// The checkpoint's mesh, e.g. `tp2·cp1·dp4·ep1·etp2`.
    pub mesh: Option<String>,
    /// Bytes published (listed in the manifest), or of the checkpoint.
    pub bytes: Option<u64>,
    /// Files published.
    pub files: Option<u64>,
    /// Whether it was uploaded (false: the checkpoint in the run's work directory).
    pub published: bool,
}

/// A run's course: its steps and tasks as spans of time.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TimelineDto {
    /// The first attempt's start; absent before any.
    pub start: Option<DateTime<Utc>>,
    /// The last attempt's end, or now while one runs.
    pub end: Option<DateTime<Utc>>,
    pub steps: Vec<TimelineStepDto>,
}

/// A step's span and its tasks'.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TimelineStepDto {
    pub step: String,
    pub start: Option<DateTime<Utc>>,
    /// Absent while one of its tasks runs (or before any started).
    pub end: Option<DateTime<Utc>>,
    pub tasks: Vec<TimelineTaskDto>,
}

/// A task's span: from its first attempt's start to its last attempt's end.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TimelineTaskDto {
    pub task: i64,
    pub name: String,
    pub state: String,
    pub attempts: u32,
    /// Absent for a task never leased.
    pub start: Option<DateTime<Utc>>,
    /// Absent while an attempt runs.
    pub end: Option<DateTime<Utc>>,
}
