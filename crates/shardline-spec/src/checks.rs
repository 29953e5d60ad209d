//! Checks of text values, each with its message and hint: upload targets, source URLs, meshes,
//! Hub repository ids and revisions, URLs, glob patterns, environment variable names.

use crate::schema::{invalid, Mismatch};
use crate::yaml::quote;

pub(crate) fn target(s: &str) -> Result<(), Mismatch> {
    if let Some(rest) = s.strip_prefix("file://") {
        return if rest.is_empty() { Err(invalid("`file://` URL has no path".to_string(), None)) } else { Ok(()) };
    }
    if s.starts_with('/') {
        return Ok(());
    }
    if let Some((scheme, rest)) = s.split_once("://") {
        if OBJECT_STORE_SCHEMES.contains(&scheme) {
            return if rest.is_empty() || rest.starts_with('/') {
                Err(invalid(format!("`{scheme}://` URL has no bucket"), None))
            } else {
                Ok(())
            };
        }
        return Err(invalid(
            format!("unsupported upload target scheme `{scheme}`"),
            Some("use `file://`, `s3://`, `gs://` or `az://` URLs, or an absolute path".to_string()),
        ));
    }
    Err(invalid(
        format!("expected a `file://` URL or an absolute path, found {}", quote(s)),
        Some(format!("write `file://{s}` for a directory relative to the working directory")),
    ))
}

/// The object-store schemes a source `path` and an upload target may use (as the publish crate
/// opens them: object_store configured from the environment).
pub(crate) const OBJECT_STORE_SCHEMES: &[&str] = &["s3", "gs", "az"];

/// Whether a source `path` names an object-store prefix (`s3://`, `gs://`, `az://`, `file://`)
/// rather than a local directory read in place.
pub fn is_object_store_source(path: &str) -> bool {
    path.split_once("://").is_some_and(|(scheme, _)| scheme == "file" || OBJECT_STORE_SCHEMES.contains(&scheme))
}

/// A URL as an `hf.download` `path`: an object-store prefix (`s3://bucket/prefix`, `gs://…`,
/// `az://…`, `file:///abs/dir`) is a source; anything else (`https://huggingface.co/org/name`,
/// `ftp://…`) is reported with the way to write it.
pub(crate) fn source_url(s: &str, scheme: &str, rest: &str) -> Result<(), Mismatch> {
    if OBJECT_STORE_SCHEMES.contains(&scheme) {
        let bucket = rest.split('/').next().unwrap_or_default();
        return if bucket.is_empty() {
            Err(invalid(
                format!("`{scheme}://` URL has no bucket"),
                Some(format!("write `{scheme}://BUCKET/PREFIX`, the prefix the release's objects are under")),
            ))
        } else if rest.contains(char::is_whitespace) {
            Err(invalid(format!("object-store URL {} contains whitespace", quote(s)), None))
        } else {
            Ok(())
        };
    }
    if scheme == "file" {
        return if rest.starts_with('/') && rest.len() > 1 {
            Ok(())
        } else {
            Err(invalid(
                format!("`file://` source URL {} has no absolute path", quote(s)),
                Some(format!(
                    "write `file:///absolute/dir`, or `path: {}` to read a local directory in place",
                    if rest.is_empty() { "DIR" } else { rest }
                )),
            ))
        };
    }
    let hub = ["huggingface.co/", "hf.co/"].iter().find_map(|h| rest.strip_prefix(h));
    let hint = match hub.map(|r| r.split('/').take(2).collect::<Vec<_>>()) {
        Some(parts) if parts.len() == 2 && !parts[1].is_empty() => {
            format!("to download from the Hub, write `repo: {}/{}` instead of `path`", parts[0], parts[1])
        }
        _ => "use a local directory, an `s3://`, `gs://`, `az://` or `file:///` URL, or download from the Hub \
              with `repo: org/name`"
            .to_string(),
    };
    Err(invalid(
        format!(
            "`hf.download` reads a local directory or an object-store prefix (`path`), or a Hub repository \
             (`repo`); `{scheme}://` sources are not supported"
        ),
        Some(hint),
    ))
}

/// A `checkpoint.reshard` `path` URL: an object-store prefix; any other scheme is refused.
pub(crate) fn checkpoint_url(s: &str, scheme: &str, rest: &str) -> Result<(), Mismatch> {
    if OBJECT_STORE_SCHEMES.contains(&scheme) || scheme == "file" {
        return source_url(s, scheme, rest);
    }
    Err(invalid(
        format!("`checkpoint.reshard` reads a local checkpoint directory or an object-store prefix; `{scheme}://` is not supported"),
        Some("use a local directory or an `s3://`, `gs://`, `az://` or `file:///` URL".to_string()),
    ))
}

/// A mesh as assignments, checked on its own ([`shardline_layout::Mesh::check`]); its canonical
/// spelling (every dimension written).
pub(crate) fn mesh_text(s: &str) -> Result<String, Mismatch> {
    let mesh = shardline_layout::Mesh::parse_assignments(s).map_err(|e| {
        invalid(
            format!("invalid mesh {}: {e}", quote(s)),
            Some("write the source mesh as `tp=2,dp=4` (cp, ep default to 1, etp to tp)".to_string()),
        )
    })?;
    if let Some(e) = mesh.check().first() {
        return Err(invalid(format!("invalid mesh {}: {e}", quote(s)), None));
    }
    Ok(mesh.assignments())
}

/// The Hub's repository id shape: one or two segments of letters, digits, `-`, `_` and `.`, no
/// `--` at either end of a segment, no `..` (as `shardline-hub` checks it).
pub(crate) fn repo_id(s: &str) -> Result<(), Mismatch> {
    let segs: Vec<&str> = s.split('/').collect();
    let ok_seg = |seg: &str| {
        !seg.is_empty()
            && seg.len() <= 96
            && seg.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && !seg.starts_with("--")
            && !seg.ends_with("--")
            && !seg.contains("..")
            && seg != "."
    };
    if (segs.len() == 1 || segs.len() == 2) && segs.iter().all(|s| ok_seg(s)) {
        return Ok(());
    }
    let hint = match s.split_once("huggingface.co/").or_else(|| s.split_once("hf.co/")) {
        Some((_, rest)) => {
            let id: Vec<&str> = rest.split('/').take(2).collect();
            format!("write the repository id only: `repo: {}`", id.join("/"))
        }
        None if segs.len() > 2 => "a repository id has at most one `/`: `org/name`".to_string(),
        None => "a repository id is `name` or `org/name` of letters, digits, `-`, `_` and `.`".to_string(),
    };
    Err(invalid(format!("invalid Hub repository id {}", quote(s)), Some(hint)))
}

/// A branch, tag, `refs/pr/N` or commit sha, usable as a `refs/` path of the HF cache.
pub(crate) fn revision(s: &str) -> Result<(), Mismatch> {
    let bad = s.is_empty()
        || s.starts_with('/')
        || s.ends_with('/')
        || s.split('/').any(|c| c.is_empty() || c == "." || c == "..")
        || s.chars().any(|c| c.is_control() || c.is_whitespace() || c == '\\');
    if bad {
        Err(invalid(
            format!("invalid revision {}", quote(s)),
            Some("a revision is a branch (`main`), a tag (`v1.0`) or a 40-hex commit sha".to_string()),
        ))
    } else {
        Ok(())
    }
}

pub(crate) fn url(s: &str) -> Result<(), Mismatch> {
    let rest = s.strip_prefix("https://").or_else(|| s.strip_prefix("http://"));
    match rest {
        Some(r) if !r.is_empty() && !r.starts_with('/') && !r.contains(char::is_whitespace) => Ok(()),
        Some(_) => Err(invalid(format!("URL {} has no host", quote(s)), None)),
        None => Err(invalid(
            format!("expected an `http://` or `https://` URL, found {}", quote(s)),
            Some("e.g. `endpoint: https://huggingface.co` (the default is `HF_ENDPOINT`, else that)".to_string()),
        )),
    }
}

/// A pattern as the Hub client matches it (`fnmatch`: `*` crosses `/`; a trailing `/` means the
/// whole folder).
pub(crate) fn glob(s: &str) -> Result<(), Mismatch> {
    if s.is_empty() {
        return Err(invalid("empty pattern".to_string(), Some("e.g. `*.safetensors`".to_string())));
    }
    let pat = if s.ends_with('/') { format!("{s}*") } else { s.to_string() };
    globset::GlobBuilder::new(&pat).literal_separator(false).backslash_escape(true).build().map(|_| ()).map_err(|e| {
        invalid(
            format!("invalid pattern {}: {}", quote(s), e.kind()),
            Some("patterns are `fnmatch` globs: `*`, `?`, `[abc]`, e.g. `*.safetensors`".to_string()),
        )
    })
}

/// Variables the worker sets for a command; a spec may not set or inherit them.
pub(crate) fn reserved_env_name(name: &str) -> bool {
    name.starts_with("SHARDLINE_") || name == "CUDA_VISIBLE_DEVICES"
}

/// An environment variable name a command may be given: `[A-Za-z_][A-Za-z0-9_]*`, not one the
/// worker sets.
pub(crate) fn env_name(s: &str) -> Result<(), Mismatch> {
    let mut chars = s.chars();
    let well_formed = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !well_formed {
        return Err(invalid(
            format!("invalid environment variable name {}", quote(s)),
            Some("names are letters, digits and `_`, not starting with a digit, e.g. `HF_HOME`".to_string()),
        ));
    }
    if reserved_env_name(s) {
        return Err(invalid(
            format!("`{s}` is set by the worker"),
            Some(
                "`CUDA_VISIBLE_DEVICES` holds the GPUs the step leased (`resources.gpus`) and `SHARDLINE_*` the \
                 output directory and the outputs of the steps it needs"
                    .to_string(),
            ),
        ));
    }
    Ok(())
}
