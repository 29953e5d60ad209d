//! The crate dependency graph, checked against what each crate's top doc comment (`lib.rs`)
//! says it may depend on. A new workspace crate, or a new dependency between workspace crates,
//! fails here until this table and that doc comment agree on it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// Each workspace crate and the workspace crates it may depend on (normal and build
/// dependencies; tests and examples may use more).
const ALLOWED: &[(&str, &[&str])] = &[
    // The pure core and the I/O shells of the data plane.
    ("shardline-layout", &[]),
    ("shardline-formats", &["shardline-layout"]),
    // Synthetic releases for `synth`, `bench` and the scale tests, written through the formats.
    ("shardline-synth", &["shardline-layout", "shardline-formats"]),
    // Leaves: small helpers, and the store, the Hub client and publishing (the store spells
    // durations with the units and backs off as everyone does).
    ("shardline-units", &[]),
    ("shardline-backoff", &[]),
    ("shardline-store", &["shardline-units", "shardline-backoff"]),
    ("shardline-hub", &["shardline-backoff"]),
    ("shardline-publish", &[]),
    // Specs are pure: the layout's config parser (for mesh checks) and the units.
    ("shardline-spec", &["shardline-layout", "shardline-units"]),
    // Contracts and submission: never the engine, the data plane's I/O, the Hub or object stores.
    ("shardline-control", &["shardline-layout", "shardline-spec", "shardline-store"]),
    // Runs tasks: everything a task needs, nothing that serves or schedules.
    (
        "shardline-engine",
        &[
            "shardline-layout",
            "shardline-formats",
            "shardline-publish",
            "shardline-hub",
            "shardline-control",
            "shardline-store",
        ],
    ),
    // Serve and submit through the control plane, never the engine.
    ("shardline-web", &["shardline-control", "shardline-spec", "shardline-store"]),
    (
        "shardline-triggers",
        &["shardline-control", "shardline-spec", "shardline-store", "shardline-hub", "shardline-backoff"],
    ),
    ("shardline-testdb", &["shardline-store"]),
];

#[test]
fn crate_dependencies_follow_the_architecture() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline", "--manifest-path"])
        .arg(root.join("Cargo.toml"))
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let members: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let mut problems = Vec::new();
    for p in packages {
        let name = p["name"].as_str().unwrap_or_default();
        if name == "shardline" {
            continue; // the binary wires everything together
        }
        let Some(ok) = allowed.get(name) else {
            problems.push(format!("`{name}` is not in ALLOWED (tests/integration/architecture.rs)"));
            continue;
        };
        for d in p["dependencies"].as_array().into_iter().flatten() {
            let dep = d["name"].as_str().unwrap_or_default();
            let dev = d["kind"].as_str() == Some("dev");
            if !dev && dep != name && members.contains(dep) && !ok.contains(&dep) {
                problems.push(format!("`{name}` must not depend on `{dep}`"));
            }
        }
    }
    for (name, _) in ALLOWED {
        if !members.contains(name) {
            problems.push(format!("ALLOWED names `{name}`, which is not a workspace crate"));
        }
    }
    assert!(problems.is_empty(), "the crate graph breaks the architecture:\n{}", problems.join("\n"));
}
