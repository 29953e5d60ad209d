//! Storage: a run's disk use (summed over the state directories whose gc measured it) in its
//! detail and view, and the storage page's policy, per-directory totals and caches.

mod common;

use std::time::Duration;

use axum::http::StatusCode;
use common::{app, Kind};
use serde_json::{json, Value};
use shardline_store::*;
use shardline_web::{AuthMode, Scope};

async fn storage(kind: Kind) {
    let app = app(kind, AuthMode::Open).await;
    let store = &app.store;
    let p = store.upsert_pipeline("convert", "steps: []", "sha256:0").await.expect("pipeline");
    let new = NewRun {
        pipeline_id: p,
        dedupe_key: None,
        params: json!({}),
        spec: json!({}),
        options: Default::default(),
        notify: Vec::new(),
        submitted_by: None,
    };
    let (run, _) = store.create_run(new).await.expect("run");
    let detail = format!("/api/v1/runs/{}", run.0);
    let (s, v) = app.get(&detail).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["disk_bytes"], Value::Null, "not measured yet");

    let (s, v) = app.get("/api/v1/storage").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v,
        json!({"retention": {"retain_runs": null, "retain_runs_s": null, "cache_max": null}, "reporters": [], "caches": []})
    );

    store
        .set_retention_policy(&RetentionPolicy {
            retain_runs: Some(Duration::from_secs(30 * 86_400)),
            cache_max: Some(500 << 30),
        })
        .await
        .expect("policy");
    let used = chrono::Utc::now();
    let entry = |path: &str, kind: DiskKind, run: Option<RunId>, bytes: u64| DiskEntry {
        path: path.into(),
        kind,
        run,
        cache_key: (kind == DiskKind::Cache).then(|| "k1".to_string()),
        bytes,
        last_used_at: (kind != DiskKind::Run).then_some(used),
    };
    store
        .report_disk_usage(
            "gpu-1:/srv/state/work",
            &[
                entry("/srv/state/work/runs/convert-1", DiskKind::Run, Some(run), 3000),
                entry("/srv/state/work/runs/convert-1/shard/checkpoint", DiskKind::Cache, None, 2000),
                entry("/srv/state/work/cache/objects/abc", DiskKind::Download, None, 500),
            ],
        )
        .await
        .expect("report");
    store
        .report_disk_usage(
            "gpu-2:/srv/state/work",
            &[entry("/srv/state/work/runs/convert-1", DiskKind::Run, Some(run), 72)],
        )
        .await
        .expect("report");

    let (_, v) = app.get(&detail).await;
    assert_eq!(v["disk_bytes"], json!(3072), "summed over the hosts");
    let (_, v) = app.get(&format!("{detail}/view")).await;
    assert_eq!(v["disk_bytes"], json!(3072));

    let (s, v) = app.get("/api/v1/storage").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v["retention"],
        json!({"retain_runs": "30d", "retain_runs_s": 2_592_000, "cache_max": 536_870_912_000u64})
    );
    let mut reporters: Vec<(String, u64, u64, u64)> = v["reporters"]
        .as_array()
        .expect("reporters")
        .iter()
        .map(|r| {
            let n = |k: &str| r[k].as_u64().unwrap_or(u64::MAX);
            (r["reporter"].as_str().unwrap_or("").to_string(), n("run_bytes"), n("cache_bytes"), n("download_bytes"))
        })
        .collect();
    reporters.sort();
    assert_eq!(
        reporters,
        [("gpu-1:/srv/state/work".to_string(), 3000, 2000, 500), ("gpu-2:/srv/state/work".to_string(), 72, 0, 0)]
    );
    let caches: Vec<(&str, &str, u64, Option<&str>)> = v["caches"]
        .as_array()
        .expect("caches")
        .iter()
        .map(|c| {
            (
                c["path"].as_str().unwrap_or(""),
                c["kind"].as_str().unwrap_or(""),
                c["bytes"].as_u64().unwrap_or(0),
                c["cache_key"].as_str(),
            )
        })
        .collect();
    assert_eq!(
        caches,
        [
            ("/srv/state/work/runs/convert-1/shard/checkpoint", "cache", 2000, Some("k1")),
            ("/srv/state/work/cache/objects/abc", "download", 500, None)
        ]
    );
    assert!(v["caches"][0]["last_used_at"].is_string());
    app.db.cleanup().await;
}

async fn storage_needs_a_read_token_when_reads_do(kind: Kind) {
    let app = app(kind, AuthMode::ReadRequiresToken).await;
    let (s, _) = app.get("/api/v1/storage").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let token = app.token(Scope::Read).await;
    let (s, v) = app.get_as("/api/v1/storage", Some(&token)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    app.db.cleanup().await;
}

shardline_testdb::on_both_backends!(storage, storage_needs_a_read_token_when_reads_do);
