//! Shared by the test binaries: the repository root and a lint context that reads model configs
//! from disk (the crate itself never does).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use shardline_layout::ModelConfig;
use shardline_spec::LintContext;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repository root")
}

/// What the CLI does: relative sources are relative to the repository root, and a source's
/// `config.json` is read when it exists.
pub fn disk_context() -> LintContext {
    LintContext::new().with_base_dir(repo_root()).with_model_config_result(|dir| {
        let file = dir.join("config.json");
        match std::fs::read_to_string(&file) {
            Ok(text) => ModelConfig::from_json(&text).map(Some).map_err(|e| e.to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", file.display())),
        }
    })
}
