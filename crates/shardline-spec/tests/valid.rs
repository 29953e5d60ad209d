//! Valid specs parse with zero diagnostics.

mod common;

use shardline_spec::{lint, render_all};

#[test]
fn valid_specs_have_no_diagnostics() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/valid");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let name = format!("valid/{}", path.file_name().unwrap().to_string_lossy());
        let (pipeline, diags) = lint(&name, &text, &common::disk_context());
        assert!(diags.is_empty(), "{}", render_all(&diags, &text));
        assert!(pipeline.is_some(), "{name}");
        seen += 1;
    }
    assert!(seen >= 3);
}
