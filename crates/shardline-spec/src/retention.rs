//! A pipeline's `retention:`: how long the work directories of its finished runs are kept
//! (`retention: {runs: 7d}`). Read by `lint::retention`; recorded with each run at submission
//! and applied by the gc of every state directory, which keeps a finished run's directory for
//! the shorter of this and the server's `--retain-runs`. It changes no step's output, so it is
//! never part of a step's hash, and it is in the spec hash only when set (specs without it keep
//! their hashes).

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use shardline_units::{format_duration, parse_duration};

/// A pipeline's `retention:`. The default (nothing set) is left out of the spec hash.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Retention {
    /// How long a finished run's work directory is kept, from when it ended.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "canonical")]
    pub runs: Option<Duration>,
}

impl Retention {
    pub fn is_default(&self) -> bool {
        *self == Retention::default()
    }
}

/// Durations in their canonical spelling (`7d`), as specs print and hash them.
mod canonical {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&format_duration(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text: Option<String> = Option::deserialize(d)?;
        text.map(|t| parse_duration(&t).map_err(serde::de::Error::custom)).transpose()
    }
}
