//! Small listings for the HTTP API: pipelines by name, the leases held now, the newest event.

use crate::db::{args, sql};
use crate::error::StoreError;
use crate::read::publish_events;
use crate::types::{Backend, Resources, RunId, TaskId, WorkerId};
use crate::Store;

/// A pipeline name with its stored versions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineSummary {
    pub name: String,
    /// Stored spec versions under this name.
    pub versions: i64,
    /// The newest version's id and spec hash.
    pub latest_id: i64,
    pub latest_spec_hash: String,
}

/// A pipeline's newest stored version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineVersion {
    pub id: i64,
    pub name: String,
    pub spec_hash: String,
    pub spec_text: String,
    /// Stored spec versions under this name.
    pub versions: i64,
}

/// A task holding a lease now, with the worker that holds it and what it uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeasedTask {
    pub id: TaskId,
    pub run: RunId,
    pub name: String,
    pub step_id: String,
    pub owner: WorkerId,
    pub resources: Resources,
}

impl Store {
    /// Pipelines with a stored spec, by name: each with its version count and newest version.
    pub async fn list_pipelines(&self) -> Result<Vec<PipelineSummary>, StoreError> {
        self.retrying("list_pipelines", || async {
            let mut c = self.pool().acquire().await?;
            let rows: Vec<(String, i64, i64, String)> = c
                .conn()
                .all(
                    sql!(
                        "SELECT p.name, g.versions, p.id, p.spec_hash FROM pipelines p \
                         JOIN (SELECT MAX(id) AS id, COUNT(*) AS versions FROM pipelines GROUP BY name) g \
                         ON g.id = p.id ORDER BY p.name"
                    ),
                    args![],
                )
                .await?;
            Ok(rows
                .into_iter()
                .map(|(name, versions, latest_id, latest_spec_hash)| PipelineSummary {
                    name,
                    versions,
                    latest_id,
                    latest_spec_hash,
                })
                .collect())
        })
        .await
    }

    /// The newest stored version of the pipeline `name`, if any.
    pub async fn latest_pipeline(&self, name: &str) -> Result<Option<PipelineVersion>, StoreError> {
        self.retrying("latest_pipeline", || async {
            let mut c = self.pool().acquire().await?;
            let row: Option<(i64, String, String, i64)> = c
                .conn()
                .opt(
                    sql!(
                        "SELECT p.id, p.spec_hash, p.spec_text, \
                         (SELECT COUNT(*) FROM pipelines q WHERE q.name = p.name) \
                         FROM pipelines p WHERE p.name = $1 ORDER BY p.id DESC LIMIT 1"
                    ),
                    args![name],
                )
                .await?;
            Ok(row.map(|(id, spec_hash, spec_text, versions)| PipelineVersion {
                id,
                name: name.to_string(),
                spec_hash,
                spec_text,
                versions,
            }))
        })
        .await
    }

    /// Tasks holding a lease now, across runs, by id.
    pub async fn leased_tasks(&self) -> Result<Vec<LeasedTask>, StoreError> {
        self.retrying("leased_tasks", || async {
            let mut c = self.pool().acquire().await?;
            type Row = (i64, i64, String, String, i64, i64, i64, i64, i64);
            let rows: Vec<Row> = c
                .conn()
                .all(
                    sql!(
                        "SELECT id, run_id, name, step_id, lease_owner, CAST(cpus AS BIGINT), \
                         CAST(memory AS BIGINT), CAST(gpus AS BIGINT), CAST(scratch AS BIGINT) FROM tasks \
                         WHERE state = 'leased' AND lease_owner IS NOT NULL ORDER BY id"
                    ),
                    args![],
                )
                .await?;
            let n = |v: i64| u64::try_from(v).unwrap_or(0);
            Ok(rows
                .into_iter()
                .map(|(id, run, name, step_id, owner, cpus, memory, gpus, scratch)| LeasedTask {
                    id: TaskId(id),
                    run: RunId(run),
                    name,
                    step_id,
                    owner: WorkerId(owner),
                    resources: Resources {
                        cpus: u32::try_from(cpus).unwrap_or(u32::MAX),
                        memory: n(memory),
                        gpus: u32::try_from(gpus).unwrap_or(u32::MAX),
                        scratch: n(scratch),
                    },
                })
                .collect())
        })
        .await
    }

    /// The id of the newest event (0 when there is none): where a follower that wants only
    /// what happens from now on starts. On PostgreSQL events get their ids when first read, so
    /// every committed event is numbered first.
    pub async fn latest_event_id(&self) -> Result<i64, StoreError> {
        self.retrying("latest_event_id", || async {
            if self.backend() == Backend::Postgres {
                publish_events(self).await?;
            }
            let mut c = self.pool().acquire().await?;
            let (id,): (i64,) = c.conn().one(sql!("SELECT COALESCE(MAX(id), 0) FROM events"), args![]).await?;
            Ok(id)
        })
        .await
    }
}
