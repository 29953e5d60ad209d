//! Path policy: which local directories and URL prefixes a submitted spec may read from and
//! write to, and whether it may run commands. A shared server refuses, at submission, a spec
//! that names anything else, with an error at the field that names it.
//!
//! Pure: the caller resolves local paths (following symlinks, joining relative paths to its base
//! directory) through the `resolve` function it passes; everything else — URL forms, percent
//! encoding, `..` segments, prefixes — is decided here.

use std::fmt;
use std::path::{Component, Path, PathBuf};

use percent_encoding::percent_decode_str;

use crate::diagnostic::Diagnostic;
use crate::model::{CheckpointSource, DownloadSource, Pipeline, ResolvedPipeline, StepConfig};

/// A root a spec may read or write under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Root {
    /// A local directory (absolute; the server resolves its symlinks once, at start).
    Dir(PathBuf),
    /// An object store or HTTP prefix: scheme, authority (bucket or host) and path segments.
    Url(UrlPrefix),
}

/// A URL split into what prefixes compare: lowercase scheme and authority, decoded segments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UrlPrefix {
    pub scheme: String,
    pub authority: String,
    pub segments: Vec<String>,
}

impl fmt::Display for Root {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Root::Dir(d) => write!(f, "{}", d.display()),
            Root::Url(u) => write!(f, "{}://{}/{}", u.scheme, u.authority, u.segments.join("/")),
        }
    }
}

/// What a server lets submissions through its API and its triggers name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PathPolicy {
    /// Where sources may be read (`--allow-source`).
    pub sources: Vec<Root>,
    /// Where results may be written (`--allow-dest`).
    pub dests: Vec<Root>,
    /// Whether `uses: command` steps may run (`--allow-commands`).
    pub commands: bool,
}

/// A place a spec names, as the policy sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Place {
    Local(PathBuf),
    Url(UrlPrefix),
}

/// Parses a `--allow-source`/`--allow-dest` value: a URL (`s3://bucket/prefix`, `file:///dir`)
/// or an absolute directory. `resolve` gives a directory's real path.
pub fn parse_root(text: &str, resolve: &dyn Fn(&Path) -> Result<PathBuf, String>) -> Result<Root, String> {
    let place = if text.contains("://") {
        parse_url(text)?
    } else {
        let p = Path::new(text);
        if !p.is_absolute() {
            return Err(format!("`{text}`: a root directory must be absolute"));
        }
        Place::Local(p.to_path_buf())
    };
    Ok(match place {
        Place::Local(p) => Root::Dir(resolve(&p)?),
        Place::Url(u) => Root::Url(u),
    })
}

/// Reads a URL strictly: `file` URLs become local paths (`file:///a` or `file://localhost/a`,
/// never another host); every other scheme keeps its authority; segments are percent-decoded
/// and a `.` or `..` segment, an encoded `/`, a query or a fragment is refused.
fn parse_url(text: &str) -> Result<Place, String> {
    let (scheme, rest) = text.split_once("://").ok_or_else(|| format!("`{text}` is not a URL"))?;
    let scheme = scheme.to_ascii_lowercase();
    if scheme.is_empty() || !scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) {
        return Err(format!("`{text}`: `{scheme}` is not a URL scheme"));
    }
    if rest.contains(['?', '#']) {
        return Err(format!("`{text}`: a query or fragment is not allowed here"));
    }
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut segments = Vec::new();
    for raw in path.split('/').filter(|s| !s.is_empty()) {
        let decoded =
            percent_decode_str(raw).decode_utf8().map_err(|_| format!("`{text}`: `{raw}` does not decode to UTF-8"))?;
        if decoded == "." || decoded == ".." || decoded.contains(['/', '\\', '\0']) {
            return Err(format!("`{text}`: the segment `{raw}` escapes its prefix"));
        }
        segments.push(decoded.into_owned());
    }
    if scheme == "file" {
        if !(authority.is_empty() || authority.eq_ignore_ascii_case("localhost")) {
            return Err(format!("`{text}`: a file URL on another host (`{authority}`) is not a local path"));
        }
        return Ok(Place::Local(PathBuf::from(format!("/{}", segments.join("/")))));
    }
    if authority.is_empty() {
        return Err(format!("`{text}`: no bucket or host"));
    }
    Ok(Place::Url(UrlPrefix { scheme, authority: authority.to_ascii_lowercase(), segments }))
}

/// A place named by a spec field: a URL, or a local path (relative ones are the resolver's).
fn parse_place(text: &str) -> Result<Place, String> {
    if text.contains("://") {
        return parse_url(text);
    }
    let decoded = percent_decode_str(text).decode_utf8().map_err(|_| format!("`{text}` does not decode to UTF-8"))?;
    // A path that reads differently once decoded is refused: a reader that decodes would go
    // elsewhere than this check looked.
    if decoded != text {
        return Err(format!("`{text}`: percent-encoded paths are not allowed here"));
    }
    Ok(Place::Local(PathBuf::from(text)))
}

fn under(place: &Place, roots: &[Root]) -> bool {
    roots.iter().any(|root| match (root, place) {
        (Root::Dir(r), Place::Local(p)) => p.starts_with(r),
        (Root::Url(r), Place::Url(u)) => {
            r.scheme == u.scheme && r.authority == u.authority && u.segments.starts_with(&r.segments)
        }
        _ => false,
    })
}

/// Whether `path`, once resolved, is under one of `roots`; the reason it is not otherwise.
fn check_place(text: &str, roots: &[Root], resolve: &dyn Fn(&Path) -> Result<PathBuf, String>) -> Result<(), String> {
    let place = match parse_place(text)? {
        Place::Local(p) => {
            // `..` is refused as written, whatever it would resolve to: the check and the
            // reader must agree without racing on the file system.
            if p.components().any(|c| c == Component::ParentDir) {
                return Err(format!("`{text}`: `..` is not allowed in a path"));
            }
            Place::Local(resolve(&p)?)
        }
        url => url,
    };
    if under(&place, roots) {
        return Ok(());
    }
    let shown = match &place {
        Place::Local(p) => p.display().to_string(),
        Place::Url(u) => Root::Url(u.clone()).to_string(),
    };
    Err(if shown == text { format!("`{text}`") } else { format!("`{text}` (that is `{shown}`)") })
}

/// Every place the resolved pipeline names that `policy` does not allow, each as an error at the
/// field that names it (`resolve` turns a local path into the real path it reaches).
pub fn check_policy(
    pipeline: &Pipeline,
    resolved: &ResolvedPipeline,
    policy: &PathPolicy,
    resolve: &dyn Fn(&Path) -> Result<PathBuf, String>,
) -> Vec<Diagnostic> {
    let mut diags = Vec::new();
    let list = |roots: &[Root]| {
        if roots.is_empty() {
            "none".to_string()
        } else {
            roots.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
        }
    };
    for (index, step) in pipeline.step_index.iter().zip(&resolved.steps) {
        let mut named: Vec<(&str, String, bool)> = Vec::new(); // (field, value, is a destination)
        match &step.config {
            StepConfig::HfDownload { source } => match source {
                DownloadSource::Local { path } => named.push(("path", path.display().to_string(), false)),
                DownloadSource::ObjectStore { url } => named.push(("path", url.clone(), false)),
                DownloadSource::Hub { endpoint: Some(e), .. } => named.push(("endpoint", e.clone(), false)),
                DownloadSource::Hub { endpoint: None, .. } => {}
            },
            StepConfig::CheckpointReshard { source: Some(source), .. } => match source {
                CheckpointSource::Local { path } => named.push(("path", path.display().to_string(), false)),
                CheckpointSource::ObjectStore { url } => named.push(("path", url.clone(), false)),
            },
            StepConfig::CheckpointExport { like: Some(like), .. } => {
                named.push(("like", like.display().to_string(), false))
            }
            StepConfig::StoreUpload { to } => named.push(("to", to.clone(), true)),
            // A command can read and write whatever its worker can: only a server that says so
            // runs them.
            StepConfig::Command { .. } if !policy.commands => {
                let path = format!("steps[{index}].uses");
                let message = "this server does not run command steps".to_string();
                diags.push(
                    Diagnostic::at(
                        &pipeline.file,
                        pipeline.locations.span(&path),
                        &path,
                        "command-not-allowed",
                        message,
                    )
                    .with_hint("the server's operator can allow them with --allow-commands"),
                );
            }
            StepConfig::Command { .. } => {}
            StepConfig::CheckpointReshard { source: None, .. }
            | StepConfig::CheckpointExport { like: None, .. }
            | StepConfig::MegatronShard { .. }
            | StepConfig::MegatronSplitFused { .. }
            | StepConfig::CheckpointValidate {} => {}
        }
        for (field, value, dest) in named {
            let (roots, flag, what) = if dest {
                (&policy.dests, "--allow-dest", "write to")
            } else {
                (&policy.sources, "--allow-source", "read from")
            };
            if let Err(why) = check_place(&value, roots, resolve) {
                let path = format!("steps[{index}].with.{field}");
                let message = format!("this server does not let a spec {what} {why}");
                diags.push(
                    Diagnostic::at(&pipeline.file, pipeline.locations.span(&path), &path, "path-not-allowed", message)
                        .with_hint(format!("allowed ({flag}): {}", list(roots))),
                );
            }
        }
    }
    diags
}

#[cfg(test)]
mod tests;
