//! The layout core stays pure: its manifest may name only these dependencies.

#[test]
fn layout_crate_depends_on_no_io_or_async_crates() {
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap();
    let allowed = ["serde", "serde_json", "thiserror", "proptest"];
    let mut in_deps = false;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line.contains("dependencies");
            continue;
        }
        if in_deps && !line.is_empty() && !line.starts_with('#') {
            let name = line.split(['=', '.']).next().unwrap().trim();
            assert!(allowed.contains(&name), "shardline-layout must stay pure, but depends on `{name}`");
        }
    }
    // And its sources never touch the file system, processes or threads.
    let mut dirs = vec![std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/src"))];
    let mut files = 0;
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            files += 1;
            let text = std::fs::read_to_string(&path).unwrap();
            for banned in ["std::fs", "std::net", "std::process", "std::thread", "tokio", "File::"] {
                assert!(!text.contains(banned), "{} uses `{banned}`", path.display());
            }
        }
    }
    assert!(files >= 10, "only {files} source files found");
}
