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

#[test]
fn warnings_do_not_block_a_pipeline() {
    let text = "apiVersion: shardline/v1
kind: Pipeline
name: warn
params:
  spare: {type: int, default: 1}
steps:
  - {id: download, uses: hf.download, with: {path: /data/models/llama}}
";
    let (pipeline, diags) = lint("warn.yaml", text, &shardline_spec::LintContext::new());
    assert!(pipeline.is_some());
    insta::assert_snapshot!(render_all(&diags, text), @r"
    warning: param `spare` is never used
     --> warn.yaml:5:3 (params.spare)
      |
    5 |   spare: {type: int, default: 1}
      |   ^^^^^
      = hint: use it as `${{ params.spare }}` or remove it

    warning: `warn.yaml`: 1 warning
    ");
}
