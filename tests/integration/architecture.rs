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
    // The artifact store: object-store listings, ranged reads, multipart uploads by id.
    ("shardline-artifacts", &["shardline-publish"]),
    // Specs are pure: the layout's config parser (for mesh checks) and the units.
    ("shardline-spec", &["shardline-layout", "shardline-units"]),
    // Contracts and submission: never the engine, the data plane's I/O, the Hub or object stores.
    ("shardline-control", &["shardline-layout", "shardline-spec", "shardline-store"]),
    // Runs tasks (and frees what finished runs left): everything a task needs, nothing that
    // serves or schedules.
    (
        "shardline-engine",
        &[
            "shardline-layout",
            "shardline-formats",
            "shardline-ops",
            "shardline-publish",
            "shardline-artifacts",
            "shardline-hub",
            "shardline-control",
            "shardline-store",
            "shardline-units",
        ],
    ),
    // Metrics are read from the store (typed outputs from the control plane), never from the
    // processes that do the work.
    ("shardline-metrics", &["shardline-control", "shardline-store"]),
    // Serve and submit through the control plane, never the engine.
    ("shardline-web", &["shardline-control", "shardline-spec", "shardline-store", "shardline-metrics"]),
    (
        "shardline-triggers",
        &["shardline-control", "shardline-spec", "shardline-store", "shardline-hub", "shardline-backoff"],
    ),
    // Delivers the store's outbox: reads runs and triggers, never submits or runs them.
    ("shardline-notify", &["shardline-spec", "shardline-store", "shardline-backoff"]),
    ("shardline-testdb", &["shardline-store"]),
    // The operations every front end runs (convert, validate…), over the data plane alone.
    ("shardline-ops", &["shardline-layout", "shardline-formats"]),
    // The Python module: a shell over the operations and the checkpoint reader.
    ("shardline-py", &["shardline-layout", "shardline-formats", "shardline-ops"]),
];

/// The workspace's packages as `cargo metadata` describes them.
fn workspace_packages() -> Vec<Value> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline", "--manifest-path"])
        .arg(root.join("Cargo.toml"))
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata JSON");
    meta["packages"].as_array().expect("packages").clone()
}

#[test]
fn crate_dependencies_follow_the_architecture() {
    let packages = workspace_packages();
    let members: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let mut problems = Vec::new();
    for p in &packages {
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

/// Every SQL statement of the workspace is the store's (the tests' databases included, through
/// its `testing` feature): no other package, tests included, depends on the SQL driver.
#[test]
fn only_the_store_depends_on_the_sql_driver() {
    let packages = workspace_packages();
    let users: Vec<&str> = packages
        .iter()
        .filter(|p| p["dependencies"].as_array().into_iter().flatten().any(|d| d["name"] == "sqlx"))
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert_eq!(users, ["shardline-store"], "packages that depend on sqlx");
}

/// The one file allowed `unsafe` code: glibc malloc tuning in the binary. The workspace lint is
/// `unsafe_code = "deny"` (not "forbid") so that this module alone can allow it.
const UNSAFE_ALLOWED: &str = "crates/shardline-cli/src/malloc.rs";

/// Whether a line of Rust uses `unsafe` (a block, fn, impl, trait or extern block) or allows it,
/// comments aside. Strings that merely contain the word (error messages) do not count.
fn uses_unsafe(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or_default();
    let code = code.replace(char::is_whitespace, " ");
    ["unsafe {", "unsafe fn", "unsafe impl", "unsafe trait", "unsafe extern", "allow(unsafe_code)"]
        .iter()
        .any(|p| code.contains(p))
        || code.trim_end().ends_with("unsafe")
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read source directory").flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if path.is_dir() {
            if name != "target" && name != "node_modules" && !name.to_string_lossy().starts_with('.') {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn unsafe_code_is_only_in_the_malloc_module() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["crates", "tests"] {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.iter().any(|f| f.ends_with(UNSAFE_ALLOWED)), "{UNSAFE_ALLOWED} is missing");
    assert!(files.len() > 100, "only {} Rust files found", files.len());
    let mut problems = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(root).unwrap_or(file);
        // This file names the patterns it looks for.
        if rel == Path::new(UNSAFE_ALLOWED) || rel == Path::new(file!()) {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read source file");
        for (i, line) in text.lines().enumerate() {
            if uses_unsafe(line) {
                problems.push(format!("{}:{}: {}", rel.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(problems.is_empty(), "`unsafe` outside {UNSAFE_ALLOWED}:\n{}", problems.join("\n"));
}

#[test]
fn the_unsafe_check_sees_unsafe_code() {
    assert!(uses_unsafe("    unsafe {"));
    assert!(uses_unsafe("pub unsafe fn f() {}"));
    assert!(uses_unsafe("unsafe impl Send for X {}"));
    assert!(uses_unsafe("#![allow(unsafe_code)]"));
    assert!(uses_unsafe("    let x = unsafe"));
    assert!(!uses_unsafe("// SAFETY: unsafe { is fine in a comment"));
    assert!(!uses_unsafe(r#"message: format!("unsafe file path `{}`", p),"#));
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(UNSAFE_ALLOWED)).unwrap();
    assert!(text.lines().any(uses_unsafe), "the check finds the malloc module's unsafe blocks");
}
