//! Retention: the policy the server sets, the step cache as a gc sees it (use times, a use
//! counter, tags), the runs a gc needs to judge directories by, and what each state directory
//! reported holding.
//!
//! The store decides nothing here: the gc's decisions are made by the engine from these rows.
//! What the store guarantees is the fencing of a cache row's deletion: [`Store::cache_forget`]
//! deletes a row only if its use counter is the one the gc read, so an entry served (or
//! rewritten) after the gc looked is never forgotten by that gc.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::types::Json;

use crate::db::{args, sql, DbTime};
use crate::error::{Result, StoreError};
use crate::records::parse;
use crate::types::{RunId, RunState};
use crate::Store;

/// What the server keeps: finished runs' work directories for `retain_runs`, step caches up to
/// `cache_max` bytes per state directory. `None`: for ever, without limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetentionPolicy {
    pub retain_runs: Option<Duration>,
    pub cache_max: Option<u64>,
}

/// A step cache row, as a gc reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheEntry {
    pub key: String,
    pub output: Value,
    /// Last served or written.
    pub last_used_at: DateTime<Utc>,
    /// Bumped by every hit and every write: [`Store::cache_forget`] deletes only an unchanged row.
    pub uses: i64,
    /// Which runs may hit it before they know its key (`step:…`, `url:…`, `hub:…`).
    pub tags: Vec<String>,
}

/// A run as retention judges its work directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRetention {
    pub id: RunId,
    pub name: String,
    pub state: RunState,
    pub finished_at: Option<DateTime<Utc>>,
    /// The run's own `retention.runs`.
    pub retention: Option<Duration>,
}

/// A queued or running run and what its tasks say: each task's payload, and its output when it
/// has one (a retried task keeps its last output until it succeeds again).
#[derive(Debug, Clone, PartialEq)]
pub struct LiveRun {
    pub id: RunId,
    pub name: Option<String>,
    pub state: RunState,
    pub tasks: Vec<(Value, Option<Value>)>,
}

/// What a reported directory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DiskKind {
    /// A run's work directory (`<work>/runs/<run name>`).
    Run,
    /// The directory of a step cache entry (a checkpoint, a downloaded prefix).
    Cache,
    /// An object-store download no cache row names (a `cache: false` step's, a partial one):
    /// a later download of the same listing still finds it.
    Download,
}

impl DiskKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DiskKind::Run => "run",
            DiskKind::Cache => "cache",
            DiskKind::Download => "download",
        }
    }
}

impl std::str::FromStr for DiskKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<DiskKind, String> {
        [DiskKind::Run, DiskKind::Cache, DiskKind::Download]
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| format!("unknown disk usage kind `{s}`"))
    }
}

/// One directory a state directory holds, as its gc measured it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskEntry {
    pub path: String,
    pub kind: DiskKind,
    pub run: Option<RunId>,
    pub cache_key: Option<String>,
    pub bytes: u64,
    pub last_used_at: Option<DateTime<Utc>>,
}

/// A reported directory with who reported it and when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskUsageRow {
    /// `<host>:<work directory>`.
    pub reporter: String,
    pub entry: DiskEntry,
    pub measured_at: DateTime<Utc>,
}

/// A reporter's totals.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskReporter {
    pub reporter: String,
    pub measured_at: DateTime<Utc>,
    pub run_bytes: u64,
    pub cache_bytes: u64,
    pub download_bytes: u64,
    pub entries: u64,
}

#[derive(sqlx::FromRow)]
struct CacheRecord {
    key: String,
    output: Json<Value>,
    last_used_at: DbTime,
    uses: i64,
    tags: Json<Value>,
}

#[derive(sqlx::FromRow)]
struct RunRetentionRecord {
    id: i64,
    name: String,
    state: String,
    finished_at: Option<DbTime>,
    retain_ms: Option<i64>,
}

#[derive(sqlx::FromRow)]
struct LiveTaskRecord {
    id: i64,
    name: Option<String>,
    state: String,
    payload: Json<Value>,
    output: Option<Json<Value>>,
}

#[derive(sqlx::FromRow)]
struct DiskRecord {
    reporter: String,
    path: String,
    kind: String,
    run_id: Option<i64>,
    cache_key: Option<String>,
    bytes: i64,
    last_used_at: Option<DbTime>,
    measured_at: DbTime,
}

#[derive(sqlx::FromRow)]
struct ReporterRecord {
    reporter: String,
    measured_at: DbTime,
    run_bytes: i64,
    cache_bytes: i64,
    download_bytes: i64,
    entries: i64,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn unsigned(table: &'static str, column: &str, v: i64) -> Result<u64> {
    u64::try_from(v).map_err(|_| StoreError::Corrupt { table, detail: format!("`{column}` = {v} is negative") })
}

fn tags_of(v: Value) -> Vec<String> {
    match v {
        Value::Array(items) => items.into_iter().filter_map(|t| t.as_str().map(str::to_string)).collect(),
        _ => Vec::new(),
    }
}

impl Store {
    /// Records the server's retention policy (replacing the one before: the last server started
    /// sets it).
    pub async fn set_retention_policy(&self, policy: &RetentionPolicy) -> Result<(), StoreError> {
        let runs = policy.retain_runs.map(ms);
        let max = policy.cache_max.map(|b| i64::try_from(b).unwrap_or(i64::MAX));
        self.retrying("set_retention_policy", || async {
            let mut pc = self.pool().acquire().await?;
            pc.conn()
                .exec(
                    sql!(
                        "INSERT INTO retention_policy (id, retain_runs_ms, cache_max_bytes, updated_at) \
                         VALUES (1, $1, $2, {now}) ON CONFLICT (id) DO UPDATE SET \
                         retain_runs_ms = excluded.retain_runs_ms, cache_max_bytes = excluded.cache_max_bytes, \
                         updated_at = excluded.updated_at"
                    ),
                    args![runs, max],
                )
                .await?;
            Ok(())
        })
        .await
    }

    /// The recorded retention policy; keep everything when no server set one.
    pub async fn retention_policy(&self) -> Result<RetentionPolicy, StoreError> {
        self.retrying("retention_policy", || async {
            let mut pc = self.pool().acquire().await?;
            let row: Option<(Option<i64>, Option<i64>)> = pc
                .conn()
                .opt(sql!("SELECT retain_runs_ms, cache_max_bytes FROM retention_policy WHERE id = 1"), args![])
                .await?;
            let Some((runs, max)) = row else { return Ok(RetentionPolicy::default()) };
            Ok(RetentionPolicy {
                retain_runs: runs
                    .map(|v| unsigned("retention_policy", "retain_runs_ms", v).map(Duration::from_millis))
                    .transpose()?,
                cache_max: max.map(|v| unsigned("retention_policy", "cache_max_bytes", v)).transpose()?,
            })
        })
        .await
    }

    /// The cached output for a content-addressed key, marked as used now (for the gc's LRU and
    /// its fencing).
    pub async fn cache_get(&self, key: &str) -> Result<Option<Value>, StoreError> {
        self.retrying("cache_get", || async {
            let mut pc = self.pool().acquire().await?;
            let row: Option<(Json<Value>,)> = pc
                .conn()
                .opt(
                    sql!("UPDATE cache SET uses = uses + 1, last_used_at = {now} WHERE key = $1 RETURNING output"),
                    args![key],
                )
                .await?;
            Ok(row.map(|(j,)| j.0))
        })
        .await
    }

    /// The cached output for a key, without marking it used (a preview such as `shardline plan`).
    pub async fn cache_peek(&self, key: &str) -> Result<Option<Value>, StoreError> {
        self.retrying("cache_peek", || async {
            let mut pc = self.pool().acquire().await?;
            let row: Option<(Json<Value>,)> =
                pc.conn().opt(sql!("SELECT output FROM cache WHERE key = $1"), args![key]).await?;
            Ok(row.map(|(j,)| j.0))
        })
        .await
    }

    /// Stores (or replaces) the output for a key, without tags.
    pub async fn cache_put(&self, key: &str, output: &Value) -> Result<(), StoreError> {
        self.cache_put_tagged(key, output, &[]).await
    }

    /// Stores (or replaces) the output for a key with the tags that say which runs may hit it
    /// (see [`CacheEntry::tags`]).
    pub async fn cache_put_tagged(&self, key: &str, output: &Value, tags: &[String]) -> Result<(), StoreError> {
        let tags = Value::from(tags.to_vec());
        self.retrying("cache_put", || async {
            let mut pc = self.pool().acquire().await?;
            pc.conn()
                .exec(
                    sql!(
                        "INSERT INTO cache (key, output, tags, last_used_at, uses) VALUES ($1, $2, $3, {now}, 1) \
                         ON CONFLICT (key) DO UPDATE SET output = excluded.output, tags = excluded.tags, \
                         created_at = {now}, last_used_at = {now}, uses = cache.uses + 1"
                    ),
                    args![key, output, &tags],
                )
                .await?;
            Ok(())
        })
        .await
    }

    /// Every step cache row.
    pub async fn cache_entries(&self) -> Result<Vec<CacheEntry>, StoreError> {
        self.retrying("cache_entries", || async {
            let mut pc = self.pool().acquire().await?;
            let recs: Vec<CacheRecord> = pc
                .conn()
                .all(
                    sql!(
                        "SELECT key, output, COALESCE(last_used_at, created_at) AS last_used_at, uses, tags \
                         FROM cache ORDER BY key"
                    ),
                    args![],
                )
                .await?;
            Ok(recs
                .into_iter()
                .map(|r| CacheEntry {
                    key: r.key,
                    output: r.output.0,
                    last_used_at: r.last_used_at.0,
                    uses: r.uses,
                    tags: tags_of(r.tags.0),
                })
                .collect())
        })
        .await
    }

    /// Deletes the row of `key` if it was not used since it had `uses` uses; whether it did.
    /// A gc calls it before it deletes the entry's directory, and keeps the directory when it
    /// returns `false`.
    pub async fn cache_forget(&self, key: &str, uses: i64) -> Result<bool, StoreError> {
        self.retrying("cache_forget", || async {
            let mut pc = self.pool().acquire().await?;
            let n = pc.conn().exec(sql!("DELETE FROM cache WHERE key = $1 AND uses = $2"), args![key, uses]).await?;
            Ok(n > 0)
        })
        .await
    }

    /// The runs with these names (a run's name is its work directory's).
    pub async fn runs_named(&self, names: &[String]) -> Result<Vec<RunRetention>, StoreError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let names = Value::from(names.to_vec());
        self.retrying("runs_named", || async {
            let mut pc = self.pool().acquire().await?;
            let recs: Vec<RunRetentionRecord> = pc
                .conn()
                .all(
                    sql!(
                        "SELECT id, name, state, finished_at, retain_ms FROM runs \
                         WHERE name IN {strs:$1} ORDER BY id"
                    ),
                    args![&names],
                )
                .await?;
            recs.into_iter()
                .map(|r| {
                    Ok(RunRetention {
                        id: RunId(r.id),
                        name: r.name,
                        state: parse("runs", &r.state)?,
                        finished_at: r.finished_at.map(|t| t.0),
                        retention: r
                            .retain_ms
                            .map(|v| unsigned("runs", "retain_ms", v).map(Duration::from_millis))
                            .transpose()?,
                    })
                })
                .collect()
        })
        .await
    }

    /// The queued and running runs with their tasks' payloads and outputs.
    pub async fn live_runs(&self) -> Result<Vec<LiveRun>, StoreError> {
        self.retrying("live_runs", || async {
            let mut pc = self.pool().acquire().await?;
            let recs: Vec<LiveTaskRecord> = pc
                .conn()
                .all(
                    sql!(
                        "SELECT r.id, r.name, r.state, t.payload, t.output FROM runs r \
                         JOIN tasks t ON t.run_id = r.id WHERE r.state IN ('queued', 'running') \
                         ORDER BY r.id, t.id"
                    ),
                    args![],
                )
                .await?;
            let mut runs: Vec<LiveRun> = Vec::new();
            for r in recs {
                let task = (r.payload.0, r.output.map(|o| o.0));
                match runs.last_mut() {
                    Some(last) if last.id.0 == r.id => last.tasks.push(task),
                    _ => runs.push(LiveRun {
                        id: RunId(r.id),
                        name: r.name,
                        state: parse("runs", &r.state)?,
                        tasks: vec![task],
                    }),
                }
            }
            Ok(runs)
        })
        .await
    }

    /// Replaces what `reporter` (`<host>:<work directory>`) holds with `entries`, in one
    /// transaction.
    pub async fn report_disk_usage(&self, reporter: &str, entries: &[DiskEntry]) -> Result<(), StoreError> {
        self.retrying("report_disk_usage", || async {
            let mut tx = self.pool().begin().await?;
            let result = async {
                let mut c = tx.conn();
                c.exec(sql!("DELETE FROM disk_usage WHERE reporter = $1"), args![reporter]).await?;
                for e in entries {
                    c.exec(
                        sql!(
                            "INSERT INTO disk_usage (reporter, path, kind, run_id, cache_key, bytes, last_used_at, \
                             measured_at) VALUES ($1, $2, $3, $4, $5, $6, $7, {now}) \
                             ON CONFLICT (reporter, path) DO NOTHING"
                        ),
                        args![
                            reporter,
                            e.path.as_str(),
                            e.kind.as_str(),
                            e.run.map(|r| r.0),
                            e.cache_key.clone(),
                            i64::try_from(e.bytes).unwrap_or(i64::MAX),
                            e.last_used_at
                        ],
                    )
                    .await?;
                }
                Ok::<(), StoreError>(())
            }
            .await;
            tx.finish(result).await
        })
        .await
    }

    /// The bytes of a run's work directory, summed over the state directories that reported it;
    /// `None` when none did.
    pub async fn run_disk_bytes(&self, run: RunId) -> Result<Option<u64>, StoreError> {
        self.retrying("run_disk_bytes", || async {
            let mut pc = self.pool().acquire().await?;
            let (n, bytes): (i64, i64) = pc
                .conn()
                .one(
                    sql!(
                        "SELECT COUNT(*), CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM disk_usage \
                         WHERE run_id = $1 AND kind = 'run'"
                    ),
                    args![run.0],
                )
                .await?;
            if n == 0 {
                return Ok(None);
            }
            unsigned("disk_usage", "bytes", bytes).map(Some)
        })
        .await
    }

    /// Each reporter's totals, the most recent report first.
    pub async fn disk_reporters(&self) -> Result<Vec<DiskReporter>, StoreError> {
        self.retrying("disk_reporters", || async {
            let mut pc = self.pool().acquire().await?;
            let recs: Vec<ReporterRecord> = pc
                .conn()
                .all(
                    sql!(
                        "SELECT reporter, MAX(measured_at) AS measured_at, \
                         CAST(COALESCE(SUM(CASE WHEN kind = 'run' THEN bytes ELSE 0 END), 0) AS BIGINT) AS run_bytes, \
                         CAST(COALESCE(SUM(CASE WHEN kind = 'cache' THEN bytes ELSE 0 END), 0) AS BIGINT) AS cache_bytes, \
                         CAST(COALESCE(SUM(CASE WHEN kind = 'download' THEN bytes ELSE 0 END), 0) AS BIGINT) \
                         AS download_bytes, COUNT(*) AS entries \
                         FROM disk_usage GROUP BY reporter ORDER BY MAX(measured_at) DESC, reporter"
                    ),
                    args![],
                )
                .await?;
            recs.into_iter()
                .map(|r| {
                    Ok(DiskReporter {
                        reporter: r.reporter,
                        measured_at: r.measured_at.0,
                        run_bytes: unsigned("disk_usage", "bytes", r.run_bytes)?,
                        cache_bytes: unsigned("disk_usage", "bytes", r.cache_bytes)?,
                        download_bytes: unsigned("disk_usage", "bytes", r.download_bytes)?,
                        entries: unsigned("disk_usage", "entries", r.entries)?,
                    })
                })
                .collect()
        })
        .await
    }

    /// The reported directories of `kinds`, largest first, at most `limit`.
    pub async fn disk_usage(&self, kinds: &[DiskKind], limit: i64) -> Result<Vec<DiskUsageRow>, StoreError> {
        let kinds = Value::from(kinds.iter().map(|k| k.as_str()).collect::<Vec<_>>());
        let limit = limit.clamp(1, crate::MAX_PAGE);
        self.retrying("disk_usage", || async {
            let mut pc = self.pool().acquire().await?;
            let recs: Vec<DiskRecord> = pc
                .conn()
                .all(
                    sql!(
                        "SELECT reporter, path, kind, run_id, cache_key, bytes, last_used_at, measured_at \
                         FROM disk_usage WHERE kind IN {strs:$1} ORDER BY bytes DESC, reporter, path LIMIT $2"
                    ),
                    args![&kinds, limit],
                )
                .await?;
            recs.into_iter()
                .map(|r| {
                    Ok(DiskUsageRow {
                        reporter: r.reporter,
                        entry: DiskEntry {
                            path: r.path,
                            kind: r
                                .kind
                                .parse()
                                .map_err(|detail| StoreError::Corrupt { table: "disk_usage", detail })?,
                            run: r.run_id.map(RunId),
                            cache_key: r.cache_key,
                            bytes: unsigned("disk_usage", "bytes", r.bytes)?,
                            last_used_at: r.last_used_at.map(|t| t.0),
                        },
                        measured_at: r.measured_at.0,
                    })
                })
                .collect()
        })
        .await
    }
}
