//! The task graph of pipelines, built from their YAML.

use super::*;

fn graph(text: &str) -> Vec<NewTask> {
    graph_on(text, None)
}

fn graph_on(text: &str, artifacts: Option<&str>) -> Vec<NewTask> {
    let (pipeline, diags) = shardline_spec::lint("p.yaml", text, &shardline_spec::LintContext::new());
    assert!(diags.is_empty(), "{}", shardline_spec::render_all(&diags, text));
    let run = pipeline.expect("pipeline").instantiate(&[], "r1").expect("instantiate");
    tasks_for(&run, Path::new("/w/runs/r1"), Path::new("/base"), artifacts).expect("tasks")
}

fn payload(tasks: &[NewTask], name: &str) -> (Vec<String>, Payload) {
    let t = tasks.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no task `{name}`"));
    (t.needs.clone(), serde_json::from_value(t.payload.clone()).expect("payload"))
}

#[test]
fn reshard_and_export_read_the_nearest_checkpoint_and_the_download() {
    let tasks = graph(
        "apiVersion: shardline/v1
kind: Pipeline
name: p
steps:
  - {id: download, uses: hf.download, with: {path: rel/model}}
  - {id: shard, uses: megatron.shard, needs: [download], with: {tp: 1, dp: 2, vocab_divisible_by: 64}}
  - {id: split, uses: megatron.split_fused, needs: [shard]}
  - {id: reshard, uses: checkpoint.reshard, needs: [split], with: {tp: 2, dp: 1, rng: drop}}
  - {id: export, uses: checkpoint.export, needs: [reshard], with: {max_file_size: 1GB}}
  - {id: up, uses: store.upload, needs: [export], with: {to: /out}}
",
    );
    // Split by rank: a task per target rank file (tp2·dp1: two), each reading the source, then
    // the reshard committing them.
    let (needs, Payload::Reshard { job }) = payload(&tasks, "reshard") else { panic!("reshard payload") };
    assert_eq!(needs, ["split", "reshard/rank-0", "reshard/rank-1"]);
    assert_eq!(job.source, ReshardSource::Task { task: "split".into() });
    assert!(job.split);
    for rank in 0..2u64 {
        let name = format!("reshard/rank-{rank}");
        let (needs, Payload::ReshardRank { job: r, rank: got }) = payload(&tasks, &name) else { panic!("{name}") };
        assert_eq!((needs, got, &r), (vec!["split".to_string()], rank, &job));
        assert_eq!(tasks.iter().find(|t| t.name == name).map(|t| t.kind.as_str()), Some(kinds::RESHARD_RANK));
    }
    assert_eq!((job.mesh_text().as_str(), job.rng.as_str()), ("tp=2,cp=1,dp=1,ep=1,etp=2", "drop"));
    assert_eq!((job.release_task.as_deref(), job.vocab_divisible_by), (Some("download"), Some(64)));
    assert_eq!(job.out, PathBuf::from("/w/runs/r1/reshard/checkpoint"));
    let (_, Payload::Export { job }) = payload(&tasks, "export") else { panic!("export payload") };
    assert_eq!((job.checkpoint_task.as_str(), job.release_task.as_deref()), ("reshard", Some("download")));
    assert_eq!((job.like, job.max_file_size, job.prefix.as_str()), (None, 1_000_000_000, "model.module."));
    let (_, Payload::Upload { checkpoint_task, source_task, .. }) = payload(&tasks, "up") else { panic!() };
    assert_eq!((checkpoint_task.as_str(), source_task.as_deref()), ("export", Some("download")));
}

#[test]
fn a_command_reads_the_terminal_tasks_of_its_needs() {
    let tasks = graph(
        "apiVersion: shardline/v1
kind: Pipeline
name: p
steps:
  - {id: download, uses: hf.download, with: {path: rel/model}}
  - {id: shard, uses: megatron.shard, needs: [download], with: {tp: 1, dp: 2}}
  - {id: load-check, uses: command, needs: [shard, download], with: {run: [python3, c.py], workdir: tools}}
",
    );
    let (needs, Payload::Command { job }) = payload(&tasks, "load-check") else { panic!("command payload") };
    assert_eq!(needs, ["shard/commit", "download"]);
    let inputs: Vec<(&str, &str)> = job.inputs.iter().map(|i| (i.step.as_str(), i.task.as_str())).collect();
    assert_eq!(inputs, [("shard", "shard/commit"), ("download", "download")]);
    assert_eq!((job.workdir, job.out), ("/base/tools".into(), "/w/runs/r1/load-check/out".into()));
    assert_eq!(tasks.iter().find(|t| t.name == "load-check").map(|t| t.kind.as_str()), Some(kinds::COMMAND));
    assert_eq!(step_env_prefix("load-check"), "SHARDLINE_STEP_LOAD_CHECK_");
}

/// The rank tasks of a 4-rank reshard step.
fn ranks(step: &str) -> Vec<String> {
    (0..4).map(|r| format!("{step}/rank-{r}")).collect()
}

#[test]
fn a_reshard_of_an_object_store_prefix_fetches_it_first() {
    let tasks = graph(
        "apiVersion: shardline/v1
kind: Pipeline
name: p
steps:
  - {id: reshard, uses: checkpoint.reshard, with: {path: s3://b/ckpt, tp: 1, dp: 4}}
  - {id: local, uses: checkpoint.reshard, needs: [reshard], with: {path: ckpt, tp: 2, dp: 2}}
  - {id: up, uses: store.upload, needs: [local], with: {to: /out}}
",
    );
    let names: Vec<&str> = tasks.iter().map(|t| t.name.as_str()).collect();
    let want: Vec<String> = ["reshard/fetch".to_string()]
        .into_iter()
        .chain(ranks("reshard"))
        .chain(["reshard".to_string()])
        .chain(ranks("local"))
        .chain(["local".to_string(), "up".to_string()])
        .collect();
    assert_eq!(names, want);
    let (_, Payload::CheckpointFetch { url, cache_dir, .. }) = payload(&tasks, "reshard/fetch") else { panic!() };
    assert_eq!((url.as_str(), cache_dir), ("s3://b/ckpt", PathBuf::from("/w/cache/objects")));
    let (needs, Payload::Reshard { job }) = payload(&tasks, "reshard") else { panic!() };
    let commit_needs = |first: &str, step: &str| [first.to_string()].into_iter().chain(ranks(step)).collect::<Vec<_>>();
    assert_eq!(
        (needs, job.source),
        (commit_needs("reshard/fetch", "reshard"), ReshardSource::Task { task: "reshard/fetch".into() })
    );
    let (needs, Payload::Reshard { job }) = payload(&tasks, "local") else { panic!() };
    assert_eq!(
        (needs, job.source),
        (commit_needs("reshard", "local"), ReshardSource::Local { path: "/base/ckpt".into() })
    );
    let (_, Payload::Upload { checkpoint_task, source_task, .. }) = payload(&tasks, "up") else { panic!() };
    assert_eq!((checkpoint_task.as_str(), source_task), ("local", None));
}

#[test]
fn on_an_artifact_store_a_validation_is_split_by_rank_file() {
    let text = "apiVersion: shardline/v1
kind: Pipeline
name: p
steps:
  - {id: download, uses: hf.download, with: {path: rel/model}}
  - {id: shard, uses: megatron.shard, needs: [download], with: {tp: 2, dp: 3}}
  - {id: split, uses: megatron.split_fused, needs: [shard]}
  - {id: validate, uses: checkpoint.validate, needs: [split]}
  - {id: reshard, uses: checkpoint.reshard, needs: [split], with: {tp: 1, dp: 2, rng: drop}}
  - {id: check, uses: checkpoint.validate, needs: [reshard]}
";
    let tasks = graph_on(text, Some("s3://b/p"));
    let parts: Vec<String> = (0..6).map(|i| format!("validate/part-{i}")).collect();
    for (i, name) in parts.iter().enumerate() {
        let (needs, Payload::ValidatePart { checkpoint_task, part, parts, .. }) = payload(&tasks, name) else {
            panic!("part payload")
        };
        assert_eq!((needs, checkpoint_task.as_str(), part, parts), (vec!["split".to_string()], "split", i as u64, 6));
    }
    let (needs, Payload::Validate { parts: named, .. }) = payload(&tasks, "validate") else { panic!() };
    assert_eq!((&needs, &named), (&parts, &parts));
    let (needs, Payload::Validate { checkpoint_task, parts, .. }) = payload(&tasks, "check") else { panic!() };
    assert_eq!((needs.len(), checkpoint_task.as_str(), parts.len()), (2, "reshard", 2));
    // On a local work directory one task reads the checkpoint whole.
    let tasks = graph(text);
    assert!(!tasks.iter().any(|t| t.kind == kinds::VALIDATE_PART));
    let (needs, Payload::Validate { parts, .. }) = payload(&tasks, "validate") else { panic!() };
    assert_eq!((needs, parts.len()), (vec!["split".to_string()], 0));
}

#[test]
fn parts_take_every_nth_storage_file_in_name_order() {
    let names: Vec<String> =
        [".metadata", "__10_0.distcp", "__0_0.distcp", "__2_0.distcp", "__1_0.distcp"].map(String::from).to_vec();
    assert_eq!(part_files(&names, 0, 2), ["__0_0.distcp", "__1_0.distcp"]);
    assert_eq!(part_files(&names, 1, 2), ["__10_0.distcp", "__2_0.distcp"]);
    let all: Vec<String> = (0..4).flat_map(|p| part_files(&names, p, 4)).collect();
    assert_eq!(all.len(), 4, "every storage file in exactly one part");
}

#[test]
fn a_reshard_is_one_task_on_an_artifact_store_or_for_one_rank() {
    let text = "apiVersion: shardline/v1
kind: Pipeline
name: p
steps:
  - {id: one, uses: checkpoint.reshard, with: {path: ckpt, tp: 1, dp: 1}}
  - {id: four, uses: checkpoint.reshard, needs: [one], with: {path: ckpt, tp: 2, dp: 2}}
";
    let names = |tasks: &[NewTask]| tasks.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    let remote = graph_on(text, Some("s3://b/artifacts"));
    assert_eq!(names(&remote), ["one", "four"]);
    let (_, Payload::Reshard { job }) = payload(&remote, "four") else { panic!() };
    assert!(!job.split && job.remote.is_some());
    let local = graph(text);
    assert_eq!(names(&local), ["one", "four/rank-0", "four/rank-1", "four/rank-2", "four/rank-3", "four"]);
}

#[test]
fn an_export_in_parts_is_a_task_per_part_then_its_commit() {
    let text = "apiVersion: shardline/v1
kind: Pipeline
name: p
steps:
  - {id: download, uses: hf.download, with: {path: rel/model}}
  - {id: shard, uses: megatron.shard, needs: [download], with: {tp: 1, dp: 1}}
  - {id: export, uses: checkpoint.export, needs: [shard], with: {parts: 3}}
";
    let tasks = graph(text);
    let names: Vec<&str> = tasks.iter().map(|t| t.name.as_str()).filter(|n| n.starts_with("export")).collect();
    assert_eq!(names, ["export/part-0", "export/part-1", "export/part-2", "export"]);
    let (needs, Payload::Export { job }) = payload(&tasks, "export") else { panic!("export payload") };
    assert_eq!(needs, ["shard/commit", "export/part-0", "export/part-1", "export/part-2"]);
    assert_eq!(job.parts, 3);
    for part in 0..3u64 {
        let name = format!("export/part-{part}");
        let (needs, Payload::ExportPart { job: j, part: got }) = payload(&tasks, &name) else { panic!("{name}") };
        assert_eq!((needs, got, &j), (vec!["shard/commit".to_string()], part, &job));
        assert_eq!(tasks.iter().find(|t| t.name == name).map(|t| t.kind.as_str()), Some(kinds::EXPORT_PART));
    }
    // On an object-store artifact store, one task.
    let remote = graph_on(text, Some("s3://b/artifacts"));
    let names: Vec<&str> = remote.iter().map(|t| t.name.as_str()).filter(|n| n.starts_with("export")).collect();
    assert_eq!(names, ["export"]);
    let (_, Payload::Export { job }) = payload(&remote, "export") else { panic!() };
    assert_eq!(job.parts, 1);
}
