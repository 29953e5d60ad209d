//! What a run's page shows of its outcome and its course, computed from its rows: where the
//! result was published (the upload's destination and manifest, the checkpoint's mesh, bytes)
//! and a timeline of steps and tasks from their attempts' start and end times. Pure functions,
//! tested without a database.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde::Deserialize;
use shardline_control::graph::Payload;
use shardline_control::TaskOutput;
use shardline_store::{AttemptRow, TaskRow, TaskState};

use crate::dto::{ResultDto, TimelineStepDto, TimelineTaskDto};
use crate::redact::redact_line;

/// Where a run's result went: the last succeeded upload, with the mesh of the checkpoint it
/// uploaded; without an upload, the last succeeded checkpoint (commit, reshard, export) with its
/// directory. `None` while nothing is published or written.
pub fn result_of(tasks: &[TaskRow]) -> Option<ResultDto> {
    let outputs: HashMap<&str, TaskOutput> = crate::view::outputs_by_name(tasks);
    let succeeded = || tasks.iter().rev().filter(|t| t.state == TaskState::Succeeded);
    let upload = succeeded().find_map(|t| match Payload::deserialize(&t.payload).ok()? {
        Payload::Upload { checkpoint_task, .. } => Some((t, checkpoint_task)),
        _ => None,
    });
    if let Some((task, checkpoint_task)) = upload {
        let out = outputs.get(task.name.as_str())?;
        let checkpoint = outputs.get(checkpoint_task.as_str());
        return Some(ResultDto {
            step: task.step_id.clone(),
            dest: out.dest.as_deref().map(redact_line),
            manifest: out.manifest_url.as_deref().map(redact_line),
            mesh: checkpoint.and_then(|c| c.mesh.clone()),
            bytes: out.published_bytes.or(checkpoint.and_then(|c| c.bytes)).or(out.bytes),
            files: out.files,
            published: true,
        });
    }
    // No upload: the checkpoint the run wrote last is its result, in its work directory.
    succeeded().find_map(|t| {
        let out = outputs.get(t.name.as_str())?;
        let dir = out.dir.as_ref()?;
        Some(ResultDto {
            step: t.step_id.clone(),
            dest: Some(redact_line(&dir.display().to_string())),
            manifest: None,
            mesh: out.mesh.clone(),
            bytes: out.bytes,
            files: None,
            published: false,
        })
    })
}

/// Each step in the order its tasks were created, with each task's span: from its first
/// attempt's start to its last attempt's end (`None` while one runs). Tasks never leased (served
/// from the cache before a lease, cancelled while waiting) have no span.
pub fn timeline(tasks: &[TaskRow], attempts: &[AttemptRow]) -> Vec<TimelineStepDto> {
    let mut by_task: HashMap<i64, Vec<&AttemptRow>> = HashMap::new();
    for a in attempts {
        by_task.entry(a.task.0).or_default().push(a);
    }
    let mut steps: Vec<TimelineStepDto> = Vec::new();
    for t in tasks {
        let mine = by_task.get(&t.id.0).map(Vec::as_slice).unwrap_or_default();
        let start = mine.iter().map(|a| a.started_at).min();
        let open = mine.iter().any(|a| a.ended_at.is_none());
        let end = if open { None } else { mine.iter().filter_map(|a| a.ended_at).max() };
        let span = TimelineTaskDto {
            task: t.id.0,
            name: redact_line(&t.name),
            state: t.state.as_str().into(),
            attempts: mine.len() as u32,
            start,
            end,
        };
        match steps.iter_mut().find(|s| s.step == t.step_id) {
            Some(s) => s.tasks.push(span),
            None => {
                steps.push(TimelineStepDto { step: redact_line(&t.step_id), start: None, end: None, tasks: vec![span] })
            }
        }
    }
    for s in &mut steps {
        s.start = s.tasks.iter().filter_map(|t| t.start).min();
        // A step has ended when each of its leased tasks has; a running one has no end yet.
        let running = s.tasks.iter().any(|t| t.start.is_some() && t.end.is_none());
        s.end = if running { None } else { s.tasks.iter().filter_map(|t| t.end).max() };
    }
    steps
}

/// The earliest start and latest end (`now` while something runs) of a timeline.
pub fn bounds(steps: &[TimelineStepDto], now: DateTime<Utc>) -> Option<(DateTime<Utc>, DateTime<Utc>)> {
    let start = steps.iter().filter_map(|s| s.start).min()?;
    let open = steps.iter().any(|s| s.start.is_some() && s.end.is_none());
    let end = if open { now } else { steps.iter().filter_map(|s| s.end).max().unwrap_or(now) };
    Some((start, end.max(start)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration;
    use serde_json::json;
    use shardline_store::{AttemptKind, AttemptOutcome, Resources, RunId, TaskId};

    fn task(
        id: i64,
        name: &str,
        step: &str,
        state: TaskState,
        payload: serde_json::Value,
        output: Option<serde_json::Value>,
    ) -> TaskRow {
        TaskRow {
            id: TaskId(id),
            run: RunId(1),
            name: name.into(),
            step_id: step.into(),
            kind: "test".into(),
            state,
            priority: 0,
            resources: Resources::default(),
            payload,
            output,
            progress: None,
            attempt: 1,
            attempt_base: 0,
            max_attempts: 1,
            max_lost: 1,
            lost: 0,
            backoff: std::time::Duration::ZERO,
            timeout: std::time::Duration::ZERO,
            ready_at: None,
            lease_owner: None,
            lease_token: 0,
            leased_at: None,
            lease_expires_at: None,
            heartbeat_at: None,
            cache_key: None,
            error: None,
            created_at: Utc::now(),
            finished_at: None,
        }
    }

    #[test]
    fn result_names_destination_manifest_mesh_and_bytes() {
        let commit = task(
            1,
            "convert.commit",
            "convert",
            TaskState::Succeeded,
            json!({"role": "commit"}),
            Some(json!({"dir": "/w/ckpt", "mesh": "tp2·cp1·dp1·ep1·etp1", "bytes": 100})),
        );
        let upload = task(
            2,
            "publish",
            "publish",
            TaskState::Succeeded,
            json!({"role": "upload", "checkpoint_task": "convert.commit", "to": "file:///out", "step_hash": "x"}),
            Some(
                json!({"dest": "file:///out", "manifest_url": "file:///out/shardline-manifest.json", "published_bytes": 120, "files": 3}),
            ),
        );
        let r = result_of(&[commit.clone(), upload]).expect("result");
        assert_eq!(r.dest.as_deref(), Some("file:///out"));
        assert_eq!(r.manifest.as_deref(), Some("file:///out/shardline-manifest.json"));
        assert_eq!(r.mesh.as_deref(), Some("tp2·cp1·dp1·ep1·etp1"));
        assert_eq!((r.bytes, r.files, r.published), (Some(120), Some(3), true));
        // Without an upload, the checkpoint in the work directory.
        let r = result_of(&[commit]).expect("result");
        assert_eq!((r.dest.as_deref(), r.published), (Some("/w/ckpt"), false));
        assert!(result_of(&[]).is_none());
    }

    #[test]
    fn timeline_spans_steps_and_tasks() {
        let t0 = Utc::now() - Duration::seconds(60);
        let a = task(1, "a", "s", TaskState::Succeeded, json!(null), None);
        let b = task(2, "b", "s", TaskState::Leased, json!(null), None);
        let c = task(3, "c", "t", TaskState::Blocked, json!(null), None);
        let att = |task: i64, n: i32, from: i64, to: Option<i64>| AttemptRow {
            task: TaskId(task),
            run: RunId(1),
            attempt: n,
            token: n as i64,
            worker: None,
            worker_name: "w".into(),
            started_at: t0 + Duration::seconds(from),
            ended_at: to.map(|s| t0 + Duration::seconds(s)),
            outcome: to.map(|_| AttemptOutcome::Failed),
            kind: to.map(|_| AttemptKind::Error),
            error: None,
        };
        let steps = timeline(&[a, b, c], &[att(1, 1, 0, Some(5)), att(1, 2, 6, Some(9)), att(2, 1, 2, None)]);
        assert_eq!(steps.len(), 2);
        assert_eq!(steps[0].tasks.len(), 2);
        assert_eq!(steps[0].tasks[0].start, Some(t0));
        assert_eq!(steps[0].tasks[0].end, Some(t0 + Duration::seconds(9)));
        assert_eq!(steps[0].tasks[0].attempts, 2);
        assert_eq!(steps[0].tasks[1].end, None, "still running");
        assert_eq!((steps[0].start, steps[0].end), (Some(t0), None));
        assert_eq!((steps[1].start, steps[1].end), (None, None), "never leased");
        let now = t0 + Duration::seconds(30);
        assert_eq!(bounds(&steps, now), Some((t0, now)));
    }
}
