//! The escape table: every way of naming a place outside the roots is refused at its line, and
//! what is inside them passes.

use std::path::{Path, PathBuf};

use super::*;
use crate::{lint, LintContext};

/// A file system of the mind: relative paths are under `/srv/work`, `/data/releases/link`
/// points at `/etc`, and every other path is itself.
fn resolve(p: &Path) -> Result<PathBuf, String> {
    let p = if p.is_relative() { Path::new("/srv/work").join(p) } else { p.to_path_buf() };
    match p.strip_prefix("/data/releases/link") {
        Ok(rest) => Ok(Path::new("/etc").join(rest)),
        Err(_) => Ok(p),
    }
}

fn policy() -> PathPolicy {
    let root = |s: &str| parse_root(s, &resolve).unwrap();
    PathPolicy {
        sources: vec![root("/data/releases"), root("s3://models/releases"), root("https://hub.internal")],
        dests: vec![root("/data/out"), root("s3://models/checkpoints")],
        commands: false,
    }
}

/// The download's `path` and the upload's `to`, lint, instantiate, check: the diagnostics'
/// (line, code) and messages.
fn check(source: &str, dest: &str) -> Vec<(usize, String, String)> {
    let text = format!(
        "apiVersion: shardline/v1\nkind: Pipeline\nname: p\nparams:\n  src: {{type: string, default: \"{source}\"}}\n\
         steps:\n  - id: download\n    uses: hf.download\n    with: {{path: \"${{{{ params.src }}}}\"}}\n\
         \x20 - id: shard\n    uses: megatron.shard\n    needs: [download]\n    with: {{tp: 1, dp: 1}}\n\
         \x20 - id: upload\n    uses: store.upload\n    needs: [shard]\n    with:\n      to: \"{dest}\"\n"
    );
    let (pipeline, diags) = lint("p.yaml", &text, &LintContext::new());
    // Some forms (`file://` with a host) are refused by lint already, at the same field.
    let diags = match pipeline {
        Some(p) if diags.iter().all(|d| !d.is_error()) => match p.instantiate(&[], "run-1") {
            Ok(resolved) => check_policy(&p, &resolved, &policy(), &resolve),
            Err(d) => d,
        },
        _ => diags.into_iter().filter(Diagnostic::is_error).collect(),
    };
    diags.into_iter().map(|d| (d.line, d.path.clone(), d.message)).collect()
}

#[test]
fn places_inside_the_roots_pass() {
    for (source, dest) in [
        ("/data/releases/llama", "file:///data/out/llama"),
        ("file:///data/releases/llama", "s3://models/checkpoints/llama"),
        ("/data/releases/llama/", "s3://models/checkpoints/llama/"),
        ("s3://models/releases/llama", "/data/out"),
        ("/data/releases/llama", "file:///data/out/a%20b"),
    ] {
        assert_eq!(check(source, dest), vec![], "{source} → {dest}");
    }
}

#[test]
fn every_escape_is_refused_at_its_line() {
    let escapes = [
        "/etc/passwd",
        "relative/release",
        "../releases/llama",
        "/data/releases/../../etc",
        "/data/releases/link/shadow",
        "/data/releases-other/llama",
        "/data/releases/%2e%2e/etc",
        "file:///etc",
        "file://otherhost/data/releases/llama",
        "file:///data/releases/%2e%2e/%2e%2e/etc",
        "file:///data/releases/a%2f..%2f..%2fetc",
        "s3://models/releases-other/x",
        "s3://models/releases/../checkpoints",
        "s3://other/releases/llama",
        "gs://models/releases/llama",
    ];
    for escape in escapes {
        let got = check(escape, "s3://models/checkpoints/x");
        assert_eq!(got.len(), 1, "`{escape}` was not refused exactly once: {got:?}");
        let (line, path, message) = &got[0];
        // The spec names it through a param: the error is at the download's `path`.
        assert_eq!((*line, path.as_str()), (9, "steps[0].with.path"), "{escape}");
        // Refused by the policy, or (a `file://` URL with a host) by lint already.
        assert!(message.contains("does not let a spec read from") || message.contains("file://"), "{message}");
    }
    for escape in ["file:///tmp/x", "/tmp/x", "s3://models/checkpoints-old", "file:///data/out/../../etc", "x"] {
        let got = check("/data/releases/llama", escape);
        assert_eq!(got.len(), 1, "`{escape}` was not refused: {got:?}");
        assert_eq!((got[0].0, got[0].1.as_str()), (18, "steps[2].with.to"), "{escape}");
        assert!(got[0].2.contains("write to") || escape == "x", "{}", got[0].2);
    }
}

#[test]
fn a_symlink_is_judged_where_it_leads_and_the_message_says_so() {
    let got = check("/data/releases/link/shadow", "/data/out");
    assert_eq!(
        got[0].2,
        "this server does not let a spec read from `/data/releases/link/shadow` (that is `/etc/shadow`)"
    );
}

#[test]
fn roots_are_absolute_directories_or_urls() {
    assert!(parse_root("data", &resolve).unwrap_err().contains("must be absolute"));
    assert!(parse_root("file://nas/share", &resolve).unwrap_err().contains("another host"));
    assert_eq!(parse_root("file:///data/releases", &resolve), Ok(Root::Dir("/data/releases".into())));
    assert_eq!(parse_root("/data/releases/link", &resolve), Ok(Root::Dir("/etc".into())));
}

#[test]
fn a_hub_endpoint_is_a_source_too() {
    let spec = |endpoint: &str| {
        format!(
            "apiVersion: shardline/v1\nkind: Pipeline\nname: p\nsteps:\n  - id: download\n    uses: hf.download\n\
             \x20   with: {{repo: org/model, endpoint: \"{endpoint}\"}}\n"
        )
    };
    for (endpoint, refused) in [
        ("https://hub.internal", false),
        ("https://hub.internal/mirror", false),
        ("https://hub.internal.evil.com", true),
        ("http://169.254.169.254", true),
        ("https://hub.internal/x?redirect=http://169.254.169.254/", true),
    ] {
        let text = spec(endpoint);
        let (pipeline, diags) = lint("p.yaml", &text, &LintContext::new());
        let pipeline = pipeline.unwrap_or_else(|| panic!("{}", crate::render_all(&diags, &text)));
        let resolved = pipeline.instantiate(&[], "run-1").unwrap();
        let got = check_policy(&pipeline, &resolved, &policy(), &resolve);
        assert_eq!(got.len(), usize::from(refused), "{endpoint}: {got:?}");
        if refused {
            assert_eq!((got[0].line, got[0].path.as_str()), (7, "steps[0].with.endpoint"));
        }
    }
}

#[test]
fn command_steps_need_the_server_to_allow_them() {
    let text = "apiVersion: shardline/v1\nkind: Pipeline\nname: p\nsteps:\n  - id: check\n    uses: command\n\
                \x20   with: {run: [\"true\"]}\n";
    let (pipeline, diags) = lint("p.yaml", text, &LintContext::new());
    let pipeline = pipeline.unwrap_or_else(|| panic!("{}", crate::render_all(&diags, text)));
    let resolved = pipeline.instantiate(&[], "run-1").unwrap();
    let refused = check_policy(&pipeline, &resolved, &policy(), &resolve);
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(
        (refused[0].line, refused[0].path.as_str(), refused[0].code.as_str()),
        (6, "steps[0].uses", "command-not-allowed")
    );
    let allowing = PathPolicy { commands: true, ..policy() };
    assert!(check_policy(&pipeline, &resolved, &allowing, &resolve).is_empty());
}
