//! How a pipeline's runs share the workers: `concurrency:` (how many may run at once, and what a
//! run beyond that does), `pool:` (a named pool of run slots shared across pipelines) and
//! `priority:` (the claim order of its runs' tasks). Read by `lint::limits`; the store enforces
//! them.

use serde::{Deserialize, Serialize};

/// The largest `concurrency.limit` a spec may ask for.
pub const MAX_CONCURRENCY: u32 = 10_000;
/// `priority:` and `submit --priority` lie in `-PRIORITY_RANGE..=PRIORITY_RANGE`.
pub const PRIORITY_RANGE: i64 = 1_000_000;

/// A pipeline's `concurrency:`, `pool:` and `priority:`. The default (none of them) is what a
/// spec without them gets, and is left out of the spec hash.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RunLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<ConcurrencyLimit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Higher first; 0 by default.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: i64,
}

impl RunLimits {
    pub fn is_default(&self) -> bool {
        *self == RunLimits::default()
    }
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// `concurrency: N` or `concurrency: {limit: N, overflow: queue|skip|cancel-previous}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ConcurrencyLimit {
    /// Runs of the pipeline that may run at once; at least 1.
    pub limit: u32,
    #[serde(default)]
    pub overflow: OverflowPolicy,
}

/// What a submission does when the pipeline already has `limit` live (queued or running) runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OverflowPolicy {
    /// The run is queued and starts when a running one ends.
    #[default]
    #[serde(rename = "queue")]
    Queue,
    /// No run is created; the submitter (a trigger firing, the CLI, the API) is told.
    #[serde(rename = "skip")]
    Skip,
    /// The live runs are cancelled and the new one queued.
    #[serde(rename = "cancel-previous")]
    CancelPrevious,
}

impl OverflowPolicy {
    pub(crate) const NAMES: &'static [&'static str] = &["queue", "skip", "cancel-previous"];

    pub fn as_str(self) -> &'static str {
        match self {
            OverflowPolicy::Queue => "queue",
            OverflowPolicy::Skip => "skip",
            OverflowPolicy::CancelPrevious => "cancel-previous",
        }
    }

    pub(crate) fn from_name(s: &str) -> Option<OverflowPolicy> {
        [OverflowPolicy::Queue, OverflowPolicy::Skip, OverflowPolicy::CancelPrevious]
            .into_iter()
            .find(|p| p.as_str() == s)
    }
}

/// Whether `s` is a pool name: lowercase letters, digits, `-` and `_`, at most 100 bytes (what
/// `shardline server --pool NAME=SLOTS` accepts too).
pub fn is_pool_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 100
        && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
}
