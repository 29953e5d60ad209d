//! The spec crate is pure: it is given text and returns data. Its manifest names no I/O, async,
//! database or network crate, and its sources touch no file system, process, thread or socket.

#[test]
fn spec_crate_does_no_io() {
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap();
    let allowed = [
        "shardline-layout",
        "shardline-units",
        "serde",
        "serde_json",
        "thiserror",
        "sha2",
        "hex",
        "saphyr-parser",
        "globset",
        "percent-encoding",
        "croner",
        "chrono-tz",
        "chrono",
        "proptest",
        "insta",
    ];
    let mut in_deps = false;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line.contains("dependencies");
            continue;
        }
        if in_deps && !line.is_empty() && !line.starts_with('#') {
            let name = line.split(['=', '.']).next().unwrap().trim();
            assert!(allowed.contains(&name), "shardline-spec must stay pure, but depends on `{name}`");
        }
    }
    // The units the spec is written in are as pure as the spec.
    let mut dirs = vec![
        std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/src")),
        std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shardline-units/src")),
    ];
    let mut files = Vec::new();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    assert!(files.iter().any(|f| f.ends_with("lint/mod.rs")), "the walk reaches the modules under src/");
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        for banned in ["std::fs", "std::net", "std::process", "std::thread", "std::env", "tokio", "File::", "sqlx"] {
            assert!(!text.contains(banned), "{} uses `{banned}`", path.display());
        }
    }
}
