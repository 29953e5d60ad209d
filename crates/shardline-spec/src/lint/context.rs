//! [`LintContext`]: what lint may know beyond the text (model configs, the base directory of
//! relative source paths), given by the caller since the crate reads no files.

use std::path::{Path, PathBuf};

use shardline_layout::ModelConfig;

type ModelLookup = dyn Fn(&Path) -> Result<Option<ModelConfig>, String> + Send + Sync;

/// What lint may know beyond the text: how to read a source release's model config, and the
/// directory relative `hf.download` paths are relative to. The crate itself reads no files; the
/// CLI passes a closure that reads `config.json`.
pub struct LintContext {
    base_dir: Option<PathBuf>,
    model_config: Option<Box<ModelLookup>>,
}

impl Default for LintContext {
    fn default() -> LintContext {
        LintContext::new()
    }
}

impl std::fmt::Debug for LintContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LintContext")
            .field("base_dir", &self.base_dir)
            .field("model_config", &self.model_config.as_ref().map(|_| "<fn>"))
            .finish()
    }
}

impl LintContext {
    /// No model configs, relative paths left as written: only checks that need no release.
    pub fn new() -> LintContext {
        LintContext { base_dir: None, model_config: None }
    }

    /// Relative `hf.download` paths are joined to `dir` before they are looked up.
    pub fn with_base_dir(mut self, dir: impl Into<PathBuf>) -> LintContext {
        self.base_dir = Some(dir.into());
        self
    }

    /// `lookup(source_dir)` gives the model config of a release, or `None` when it is not
    /// available (then only the model-independent mesh checks run).
    pub fn with_model_config<F>(self, lookup: F) -> LintContext
    where
        F: Fn(&Path) -> Option<ModelConfig> + Send + Sync + 'static,
    {
        self.with_model_config_result(move |p| Ok(lookup(p)))
    }

    /// As [`LintContext::with_model_config`], with an error to report (at the download step's
    /// `with.path`) when a config exists but cannot be read.
    pub fn with_model_config_result<F>(mut self, lookup: F) -> LintContext
    where
        F: Fn(&Path) -> Result<Option<ModelConfig>, String> + Send + Sync + 'static,
    {
        self.model_config = Some(Box::new(lookup));
        self
    }

    pub fn base_dir(&self) -> Option<&Path> {
        self.base_dir.as_deref()
    }

    /// A source path as the lookup sees it: joined to the base dir when relative.
    pub fn source_path(&self, path: &Path) -> PathBuf {
        match &self.base_dir {
            Some(base) if path.is_relative() => base.join(path),
            _ => path.to_path_buf(),
        }
    }

    pub(crate) fn lookup(&self, path: &Path) -> Result<Option<ModelConfig>, String> {
        match &self.model_config {
            Some(f) => f(&self.source_path(path)),
            None => Ok(None),
        }
    }
}
