//! Who did what to a run: its submitter is a column of `runs` (written by `admit_run`); every
//! cancel and retry is a row of `run_actions`, written in the transaction that does it, so a run
//! retried twice shows both and an action that rolled back shows none.

use std::collections::HashMap;

use serde_json::json;

use crate::db::{args, sql, Conn};
use crate::error::Result;
use crate::records::RunActionRecord;
use crate::types::{RunAction, RunActionKind};

/// Records `action` of `run` by `actor`, now.
pub(crate) async fn record_action(c: &mut Conn<'_>, run: i64, action: RunActionKind, actor: &str) -> Result<()> {
    c.exec(
        sql!("INSERT INTO run_actions (run_id, action, actor, at) VALUES ($1, $2, $3, {now})"),
        args![run, action.as_str(), actor],
    )
    .await?;
    Ok(())
}

/// The actions of each of `runs`, oldest first.
pub(crate) async fn actions(c: &mut Conn<'_>, runs: &[i64]) -> Result<HashMap<i64, Vec<RunAction>>> {
    let mut out: HashMap<i64, Vec<RunAction>> = HashMap::new();
    if runs.is_empty() {
        return Ok(out);
    }
    let rows: Vec<RunActionRecord> = c
        .all(
            sql!("SELECT run_id, action, actor, at FROM run_actions WHERE run_id IN {ids:$1} ORDER BY id"),
            args![json!(runs)],
        )
        .await?;
    for row in rows {
        let run = row.run_id;
        out.entry(run).or_default().push(row.into_action()?);
    }
    Ok(out)
}
