//! `triggers:`: what a valid list parses to, and the params a firing gives its run.

use std::collections::BTreeMap;

use shardline_spec::{
    lint, render_all, LintContext, MissedPolicy, Schedule, TriggerContext, TriggerKind, Watch, WatchTarget,
};

const SPEC: &str = r#"apiVersion: shardline/v1
kind: Pipeline
name: nightly
params:
  source: {type: path, default: /data/models/qwen}
  label: {type: string, default: none}
triggers:
  - schedule: {cron: "0 2 * * *", timezone: Europe/Paris, missed: skip}
    params: {label: "nightly ${{ trigger.time }}"}
  - watch: {repo: Qwen/Qwen3-0.6B, revision: main, every: 10m}
    params: {source: "/hub/${{ trigger.repo }}@${{ trigger.sha }}", label: "${{ trigger.revision }}"}
  - watch: {author: Qwen, name: "Qwen3-*", every: 1h30m}
  - schedule: {cron: "@hourly"}
steps:
  - id: download
    uses: hf.download
    with: {path: "${{ params.source }}"}
  - id: shard
    uses: megatron.shard
    needs: [download]
    with: {tp: 1, dp: 2, prefix: "${{ params.label }}."}
"#;

#[test]
fn triggers_parse_with_defaults() {
    let (pipeline, diags) = lint("nightly.yaml", SPEC, &LintContext::new());
    assert!(diags.is_empty(), "{}", render_all(&diags, SPEC));
    let p = pipeline.expect("pipeline");
    assert_eq!(p.triggers.len(), 4);
    assert_eq!(
        p.triggers[0].kind,
        TriggerKind::Schedule(Schedule {
            cron: "0 2 * * *".into(),
            timezone: "Europe/Paris".into(),
            missed: MissedPolicy::Skip
        })
    );
    assert_eq!(
        p.triggers[1].kind,
        TriggerKind::Watch(Watch {
            target: WatchTarget::Repo("Qwen/Qwen3-0.6B".into()),
            revision: "main".into(),
            every_secs: 600
        })
    );
    assert_eq!(
        p.triggers[2].kind,
        TriggerKind::Watch(Watch {
            target: WatchTarget::Author { author: "Qwen".into(), name: "Qwen3-*".into() },
            revision: "main".into(),
            every_secs: 5400
        })
    );
    // Defaults: UTC, run-once.
    assert_eq!(
        p.triggers[3].kind,
        TriggerKind::Schedule(Schedule {
            cron: "@hourly".into(),
            timezone: "UTC".into(),
            missed: MissedPolicy::RunOnce
        })
    );
    assert_eq!(p.triggers[3].index, 3);
    assert_eq!(p.triggers[1].to_string(), "Qwen/Qwen3-0.6B@main every 10m");
    assert_eq!(p.triggers[0].to_string(), "cron \"0 2 * * *\" Europe/Paris, missed: skip");
    assert_eq!(p.triggers[2].to_string(), "Qwen/Qwen3-*@main every 90m");
}

#[test]
fn a_firing_renders_its_params_as_overrides() {
    let (pipeline, _) = lint("nightly.yaml", SPEC, &LintContext::new());
    let p = pipeline.expect("pipeline");
    let ctx = TriggerContext {
        repo: Some("Qwen/Qwen3-0.6B".into()),
        sha: Some("a".repeat(40)),
        revision: Some("main".into()),
        time: "2026-03-29T00:00:00Z".into(),
    };
    let got: BTreeMap<String, String> = p.triggers[1].overrides(&ctx).into_iter().collect();
    assert_eq!(got["source"], format!("/hub/Qwen/Qwen3-0.6B@{}", "a".repeat(40)));
    assert_eq!(got["label"], "main");
    assert_eq!(p.triggers[0].overrides(&ctx), vec![("label".to_string(), "nightly 2026-03-29T00:00:00Z".to_string())]);
    assert!(p.triggers[2].overrides(&ctx).is_empty());
    // The overrides instantiate like `--set`.
    let run = p.instantiate(&p.triggers[1].overrides(&ctx), "r1").expect("instantiate");
    assert_eq!(run.params["label"], serde_json::json!("main"));
}

#[test]
fn a_pipeline_without_triggers_has_none() {
    let text = "apiVersion: shardline/v1\nkind: Pipeline\nname: m\nsteps:\n  - {id: download, uses: hf.download, with: {path: /x}}\n";
    let (pipeline, diags) = lint("m.yaml", text, &LintContext::new());
    assert!(diags.is_empty(), "{}", render_all(&diags, text));
    assert!(pipeline.expect("pipeline").triggers.is_empty());
}

#[test]
fn the_nightly_example_runs_at_two_in_paris_and_on_new_commits() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../pipelines/nightly.yaml");
    let text = std::fs::read_to_string(&path).expect("pipelines/nightly.yaml");
    let (pipeline, diags) = lint("pipelines/nightly.yaml", &text, &LintContext::new());
    assert!(diags.is_empty(), "{}", render_all(&diags, &text));
    let p = pipeline.expect("pipeline");
    assert_eq!(p.triggers.len(), 2);
    assert_eq!(
        p.triggers[0].kind,
        TriggerKind::Schedule(Schedule {
            cron: "0 2 * * *".into(),
            timezone: "Europe/Paris".into(),
            missed: MissedPolicy::RunOnce
        })
    );
    let TriggerKind::Watch(w) = &p.triggers[1].kind else { panic!("the second trigger is a watch") };
    assert_eq!(w.target, WatchTarget::Repo("Qwen/Qwen3-0.6B".into()));
    // A watch run downloads exactly the commit that fired it.
    let sha = "0123456789abcdef0123456789abcdef01234567";
    let ctx = TriggerContext {
        repo: Some("Qwen/Qwen3-0.6B".into()),
        sha: Some(sha.into()),
        revision: Some("main".into()),
        time: String::new(),
    };
    let run = p.instantiate(&p.triggers[1].overrides(&ctx), "r1").expect("instantiate");
    assert_eq!(run.params["revision"], serde_json::json!(sha));
    let download = serde_json::to_value(&run.step("download").expect("download").config).expect("json");
    assert_eq!(download["repo"], "Qwen/Qwen3-0.6B");
    assert_eq!(download["revision"], sha);
}

#[test]
fn odd_shapes_are_errors_not_panics() {
    let head = "apiVersion: shardline/v1\nkind: Pipeline\nname: m\nparams:\n  x: {type: string, default: a}\nsteps:\n  - {id: download, uses: hf.download, with: {path: \"/${{ params.x }}\"}}\n";
    for triggers in [
        "triggers: {a: 1}",
        "triggers: [1, \"x\", [], null]",
        "triggers: [{schedule: 1}, {watch: []}, {schedule: {cron: 5}}]",
        "triggers: [{watch: {repo: a/b, every: [1]}}, {watch: {repo: a/b, every: -5m}}]",
        "triggers: [{watch: {repo: a/b}, params: 3}, {watch: {repo: a/b}, params: {x: [1]}}]",
        "triggers: [{watch: {repo: a/b}, params: {x: \"${{ trigger.sha\"}}]",
        "triggers: [{watch: {author: \"\", name: \"\"}}, {watch: {author: é, name: \"a/b\"}}]",
        "triggers: [{schedule: {cron: \"\", timezone: \"\", missed: \"\"}}]",
        "triggers: [{schedule: {cron: \"@reboot\"}}, {schedule: {cron: \"0 0 31 2 *\"}}]",
    ] {
        let text = format!("{head}{triggers}\n");
        let (pipeline, diags) = lint("odd.yaml", &text, &LintContext::new());
        assert!(pipeline.is_none(), "{triggers}: expected errors");
        assert!(diags.iter().any(|d| d.path.starts_with("triggers")), "{triggers}: {}", render_all(&diags, &text));
    }
}
