//! Broken specs: each file of `tests/data/invalid` lints to at least one error, and the rendered
//! diagnostics are snapshot-tested (`cargo insta review` after a deliberate change).

mod common;

use shardline_spec::{lint, render_all, Severity};

fn rendered(name: &str, text: &str) -> String {
    let (pipeline, diags) = lint(&format!("invalid/{name}"), text, &common::disk_context());
    assert!(pipeline.is_none(), "{name}: a spec with errors gives no pipeline");
    assert!(diags.iter().any(|d| d.severity == Severity::Error), "{name}: expected at least one error");
    let positions: Vec<(usize, usize)> = diags.iter().map(|d| (d.line, d.column)).collect();
    let mut sorted = positions.clone();
    sorted.sort();
    assert_eq!(positions, sorted, "{name}: diagnostics are sorted by position");
    render_all(&diags, text)
}

#[test]
fn invalid_specs() {
    insta::glob!("data/invalid/*.yaml", |path| {
        let text = std::fs::read_to_string(path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy();
        insta::assert_snapshot!(rendered(&name, &text));
    });
}

#[test]
fn oversized_document() {
    let mut text = String::from("apiVersion: shardline/v1\nkind: Pipeline\nname: huge\ndescription: |\n");
    while text.len() <= shardline_spec::limits::MAX_FILE_BYTES {
        text.push_str("  padding padding padding padding padding padding padding padding padding\n");
    }
    insta::assert_snapshot!(rendered("huge.yaml", &text), @r"
        error: file is 1048646 bytes; pipeline files are limited to 1048576 bytes (1 MiB)
         --> invalid/huge.yaml:1:1
          |
        1 | apiVersion: shardline/v1
          | ^
          = hint: pipeline specs are a few kilobytes; check that this is the right file

        error: `invalid/huge.yaml`: 1 error
    ");
}

#[test]
fn empty_document() {
    insta::assert_snapshot!(rendered("empty.yaml", "# nothing but a comment\n"), @r"
        error: the file holds no pipeline
         --> invalid/empty.yaml:1:1
          |
        1 | # nothing but a comment
          | ^
          = hint: a pipeline starts with `apiVersion: shardline/v1`, `kind: Pipeline`, `name:` and `steps:`

        error: `invalid/empty.yaml`: 1 error
    ");
}
