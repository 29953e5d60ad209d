//! What a task says about the directories it uses, pure: the tags a step cache entry gets when
//! its task remembers it, and that a live task protects before it knows its cache key; and the
//! directories its payload and output name.
//!
//! A task can only be served an entry whose key it computes, and every key is derived from what
//! the tag names: a shard, reshard or export key from the step hash, an object-store key from
//! the URL and its listing, a Hub key from the repository and commit. So a live task's tags
//! cover every entry it may hit, whatever the listing or commit turns out to be.

use std::collections::BTreeSet;
use std::path::PathBuf;

use shardline_control::graph::{Payload, ReshardSource};
use shardline_control::TaskOutput;

/// The tags of the cache entries a task of this payload writes or may hit.
pub fn tags(payload: &Payload) -> Vec<String> {
    match payload {
        Payload::HubDownload { repo, .. } => vec![format!("hub:{repo}")],
        Payload::ObjectDownload { url, .. } | Payload::CheckpointFetch { url, .. } => vec![format!("url:{url}")],
        Payload::Plan { job } | Payload::Rank { job, .. } | Payload::Commit { job, .. } => {
            vec![format!("step:{}", job.step_hash)]
        }
        Payload::Reshard { job } => vec![format!("step:{}", job.step_hash)],
        Payload::Export { job } => vec![format!("step:{}", job.step_hash)],
        _ => Vec::new(),
    }
}

/// The directories a task reads or wrote: local sources its payload names, and the directories
/// its output reports (a checkpoint served from the cache included).
pub fn paths(payload: Option<&Payload>, output: Option<&TaskOutput>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    match payload {
        Some(Payload::Download { path, .. }) => out.push(path.clone()),
        Some(Payload::Reshard { job }) => {
            if let ReshardSource::Local { path } = &job.source {
                out.push(path.clone());
            }
        }
        Some(Payload::Export { job }) => out.extend(job.like.clone()),
        _ => {}
    }
    if let Some(o) = output {
        out.extend(o.dir.clone());
        out.extend(o.path.clone());
        if let Some(cached) = o.cached.as_ref().map(TaskOutput::from_value) {
            out.extend(cached.dir);
            out.extend(cached.path);
        }
    }
    out
}

/// The artifact-store prefixes a task's output names: its own, and that of the cached output it
/// was served (a run served from the step cache reads another run's checkpoint).
pub fn artifacts(output: Option<&TaskOutput>) -> Vec<String> {
    let Some(o) = output else { return Vec::new() };
    let cached = o.cached.as_ref().map(TaskOutput::from_value).and_then(|c| c.artifact);
    o.artifact.iter().cloned().chain(cached).collect()
}

/// A live run's tags and directories from its tasks' payloads and outputs, as the store holds
/// them (an unreadable payload or output names nothing).
pub fn of_tasks(tasks: &[(serde_json::Value, Option<serde_json::Value>)]) -> (Vec<PathBuf>, BTreeSet<String>) {
    let mut paths_out = Vec::new();
    let mut tags_out = BTreeSet::new();
    for (payload, output) in tasks {
        let payload: Option<Payload> = serde_json::from_value(payload.clone()).ok();
        let output = output.as_ref().map(TaskOutput::from_value);
        if let Some(p) = &payload {
            tags_out.extend(tags(p));
        }
        paths_out.extend(paths(payload.as_ref(), output.as_ref()));
    }
    (paths_out, tags_out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use shardline_control::graph::ShardJob;

    #[test]
    fn every_cached_kind_has_the_tag_its_key_is_derived_from() {
        let job = ShardJob { step_hash: "abc".into(), ..ShardJob::default() };
        assert_eq!(tags(&Payload::Plan { job: job.clone() }), ["step:abc"]);
        assert_eq!(tags(&Payload::Commit { job, plan_task: "shard".into() }), ["step:abc"]);
        let object = Payload::ObjectDownload {
            url: "s3://b/m".into(),
            cache_dir: "/w/cache/objects".into(),
            step_hash: "h".into(),
            cache: true,
            artifacts: None,
        };
        assert_eq!(tags(&object), ["url:s3://b/m"]);
        let hub = Payload::HubDownload {
            repo: "org/m".into(),
            revision: "main".into(),
            allow: vec![],
            ignore: vec![],
            endpoint: None,
            step_hash: "h".into(),
            cache: true,
            artifacts: None,
        };
        assert_eq!(tags(&hub), ["hub:org/m"]);
        assert!(tags(&Payload::Download { path: "/m".into(), step_hash: "h".into(), artifacts: None }).is_empty());
    }

    #[test]
    fn artifact_prefixes_come_from_outputs_and_the_cached_outputs_they_were_served() {
        let served = TaskOutput {
            cached: Some(json!({"artifact": "s3://b/p/runs/old/shard/checkpoint"})),
            ..TaskOutput::default()
        };
        assert_eq!(artifacts(Some(&served)), ["s3://b/p/runs/old/shard/checkpoint"]);
        let own = TaskOutput { artifact: Some("s3://b/p/runs/new/x".into()), ..served };
        assert_eq!(artifacts(Some(&own)), ["s3://b/p/runs/new/x", "s3://b/p/runs/old/shard/checkpoint"]);
        assert!(artifacts(None).is_empty());
    }

    #[test]
    fn paths_come_from_payloads_outputs_and_cached_outputs() {
        let plan = json!({"role": "plan", "job": {"tp": 1, "cp": 1, "dp": 1, "ep": 1, "etp": 1, "format": "dcp",
            "prefix": "", "optimizer_state": false, "vocab_divisible_by": 1, "split_fused": false,
            "source_task": "download", "out": "/w/runs/b/shard/checkpoint", "step_hash": "s"}});
        let tasks = vec![
            (
                json!({"role": "download", "path": "/models/llama", "step_hash": "d"}),
                Some(json!({"path": "/models/llama"})),
            ),
            (plan, Some(json!({"cached": {"dir": "/w/runs/a/shard/checkpoint"}}))),
            (json!({"role": "unknown-role"}), Some(json!({"dir": "/w/runs/b/x"}))),
        ];
        let (paths, tags) = of_tasks(&tasks);
        assert_eq!(
            paths,
            [
                PathBuf::from("/models/llama"),
                "/models/llama".into(),
                "/w/runs/a/shard/checkpoint".into(),
                "/w/runs/b/x".into()
            ]
        );
        assert_eq!(tags.into_iter().collect::<Vec<_>>(), ["step:s"]);
    }
}
