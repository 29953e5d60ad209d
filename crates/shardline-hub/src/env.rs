//! Endpoint, token and cache directory from the environment, as `huggingface_hub` reads them.

use std::path::{Path, PathBuf};

use crate::{HubError, Result, Secret};

/// The public Hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// What the environment says about the Hub.
#[derive(Clone, Debug)]
pub struct HubEnv {
    /// `HF_ENDPOINT`, default [`DEFAULT_ENDPOINT`]; no trailing slash.
    pub endpoint: String,
    /// `HF_TOKEN` (or the legacy `HUGGING_FACE_HUB_TOKEN`), else the file `HF_TOKEN_PATH`
    /// (default `$HF_HOME/token`).
    pub token: Option<Secret>,
    /// `HF_HUB_CACHE` (or the legacy `HUGGINGFACE_HUB_CACHE`), default `$HF_HOME/hub`.
    /// `HF_HOME` defaults to `$XDG_CACHE_HOME/huggingface`, then `~/.cache/huggingface`.
    pub cache_dir: PathBuf,
    /// `HF_HUB_OFFLINE`: no network; downloads are served from the cache or fail.
    pub offline: bool,
}

impl HubEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads variables through `get` (tests pass a map). Empty values count as unset.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let home = get("HOME").map(PathBuf::from);
        let expand = |v: String| -> PathBuf {
            match (v.strip_prefix("~/"), &home) {
                (Some(rest), Some(h)) => h.join(rest),
                _ => PathBuf::from(v),
            }
        };

        let hf_home = match get("HF_HOME") {
            Some(v) => expand(v),
            None => match get("XDG_CACHE_HOME") {
                Some(x) => expand(x).join("huggingface"),
                None => match &home {
                    Some(h) => h.join(".cache").join("huggingface"),
                    None => {
                        return Err(HubError::Config(
                            "no cache directory: set HF_HOME or HF_HUB_CACHE (HOME is unset)".into(),
                        ))
                    }
                },
            },
        };
        let cache_dir = get("HF_HUB_CACHE")
            .or_else(|| get("HUGGINGFACE_HUB_CACHE"))
            .map(expand)
            .unwrap_or_else(|| hf_home.join("hub"));

        let endpoint =
            get("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.to_owned()).trim_end_matches('/').to_owned();

        let token = match get("HF_TOKEN").or_else(|| get("HUGGING_FACE_HUB_TOKEN")) {
            Some(t) => Some(Secret::new(t)),
            None => {
                let path = get("HF_TOKEN_PATH").map(expand).unwrap_or_else(|| hf_home.join("token"));
                read_token_file(&path)?
            }
        };
        let offline = get("HF_HUB_OFFLINE")
            .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
        Ok(HubEnv { endpoint, token: token.filter(|t| !t.is_empty()), cache_dir, offline })
    }
}

fn read_token_file(path: &Path) -> Result<Option<Secret>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(Secret::new(s))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        // The message names the file only, never its content.
        Err(e) => Err(HubError::Config(format!("cannot read the token file {}: {e}", path.display()))),
    }
}
