//! Wire types of the storage page: the retention policy and what each state directory's gc
//! last measured (beside the others in `dto`, re-exported there).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use shardline_store::{DiskReporter, DiskUsageRow, RetentionPolicy};
use utoipa::ToSchema;

use crate::redact::redact_line;

/// The retention policy the server recorded (`--retain-runs`, `--cache-max`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RetentionDto {
    /// How long finished runs' work directories are kept (`30d`); null: for ever.
    pub retain_runs: Option<String>,
    /// The same in seconds.
    pub retain_runs_s: Option<u64>,
    /// Bytes of step caches and downloads kept per state directory; null: no limit.
    pub cache_max: Option<u64>,
}

impl From<RetentionPolicy> for RetentionDto {
    fn from(p: RetentionPolicy) -> RetentionDto {
        RetentionDto {
            retain_runs: p.retain_runs.map(shardline_spec::format_duration),
            retain_runs_s: p.retain_runs.map(|d| d.as_secs()),
            cache_max: p.cache_max,
        }
    }
}

/// A state directory's totals, as its last gc measured them.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DiskReporterDto {
    /// `<host>:<work directory>`.
    pub reporter: String,
    pub measured_at: DateTime<Utc>,
    /// Bytes of its runs' work directories (cache entries inside them included).
    pub run_bytes: u64,
    /// Bytes of its step cache entries.
    pub cache_bytes: u64,
    /// Bytes of object-store downloads no cache row names.
    pub download_bytes: u64,
    pub entries: u64,
}

impl From<&DiskReporter> for DiskReporterDto {
    fn from(r: &DiskReporter) -> DiskReporterDto {
        DiskReporterDto {
            reporter: redact_line(&r.reporter),
            measured_at: r.measured_at,
            run_bytes: r.run_bytes,
            cache_bytes: r.cache_bytes,
            download_bytes: r.download_bytes,
            entries: r.entries,
        }
    }
}

/// A cache entry's or download's directory on one state directory.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CacheUsageDto {
    pub reporter: String,
    pub path: String,
    /// `cache` (a step cache entry) or `download` (an object-store download no row names).
    pub kind: String,
    pub cache_key: Option<String>,
    pub bytes: u64,
    pub last_used_at: Option<DateTime<Utc>>,
    pub measured_at: DateTime<Utc>,
}

impl From<&DiskUsageRow> for CacheUsageDto {
    fn from(r: &DiskUsageRow) -> CacheUsageDto {
        CacheUsageDto {
            reporter: redact_line(&r.reporter),
            path: redact_line(&r.entry.path),
            kind: r.entry.kind.as_str().into(),
            cache_key: r.entry.cache_key.clone(),
            bytes: r.entry.bytes,
            last_used_at: r.entry.last_used_at,
            measured_at: r.measured_at,
        }
    }
}

/// The storage page: the policy, each state directory's totals, the largest caches.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct StorageDto {
    pub retention: RetentionDto,
    pub reporters: Vec<DiskReporterDto>,
    /// Step cache entries and downloads, largest first (at most 500).
    pub caches: Vec<CacheUsageDto>,
}
