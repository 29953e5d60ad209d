//! Repository ids, revisions, file listings and the allow/ignore filter.

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};

use crate::{HubError, Result};

/// A validated model repository id: `name` or `org/name`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RepoId(String);

impl RepoId {
    /// Checks the shape the Hub accepts: one or two segments of `[A-Za-z0-9._-]`, no `--`
    /// at either end, no `..`.
    pub fn parse(s: &str) -> Result<Self> {
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
            Ok(RepoId(s.to_owned()))
        } else {
            Err(HubError::InvalidRepoId(s.to_owned()))
        }
    }

    /// The id as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The cache folder name: `models--org--name`.
    pub fn cache_folder(&self) -> String {
        format!("models--{}", self.0.replace('/', "--"))
    }
}

impl std::fmt::Display for RepoId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// True for a full 40-hex lowercase commit sha (what `huggingface_hub` treats as a commit).
pub fn is_commit_sha(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Checks a revision (branch, tag, `refs/pr/N` or sha) is usable as a `refs/` path.
pub(crate) fn check_revision(rev: &str) -> Result<()> {
    let bad = rev.is_empty()
        || rev.starts_with('/')
        || rev.ends_with('/')
        || rev.split('/').any(|c| c.is_empty() || c == "." || c == "..")
        || rev.chars().any(|c| c.is_control() || c == '\\');
    if bad {
        Err(HubError::InvalidRevision(rev.to_owned()))
    } else {
        Ok(())
    }
}

/// A repository path safe to place under `snapshots/{sha}/`: relative, `/`-separated, no `.`/`..`
/// or empty components, no backslashes or NULs.
pub(crate) fn is_safe_repo_path(p: &str) -> bool {
    !p.is_empty()
        && !p.starts_with('/')
        && p.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
        && !p.chars().any(|c| c == '\\' || c == '\0')
}

/// A resolved revision: the commit and its files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoRevision {
    /// The repository id.
    pub repo: String,
    /// The revision that was asked for (branch, tag or sha).
    pub revision: String,
    /// The 40-hex commit sha it points to.
    pub sha: String,
    /// Every file of the commit, sorted by path.
    pub files: Vec<RepoFile>,
}

impl RepoRevision {
    /// Bytes of all files (what a download of everything needs on disk).
    pub fn total_size(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// One file of a commit, as the tree listing describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoFile {
    /// Path in the repository, `/`-separated.
    pub path: String,
    /// Size of the content in bytes.
    pub size: u64,
    /// sha256 of the content for LFS (and Xet) files; `None` for files stored in git.
    pub lfs_sha256: Option<String>,
    /// The git blob id (for LFS files: of the pointer). For a regular file this is the sha1 of
    /// `blob {size}\0{content}`, the `ETag` the Hub serves and the blob name in the cache.
    pub blob_id: String,
}

impl RepoFile {
    /// The name of this file's blob in the cache: the sha256 for LFS files, the git blob id otherwise
    /// (the normalised `X-Linked-Etag`/`ETag`, as `huggingface_hub` names blobs).
    pub fn cache_blob_name(&self) -> &str {
        self.lfs_sha256.as_deref().unwrap_or(&self.blob_id)
    }
}

/// A model from a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSummary {
    /// `org/name`.
    pub id: String,
    /// Head commit of the default branch, when the listing includes it.
    pub sha: Option<String>,
    /// ISO 8601 time of the last change, when the listing includes it.
    pub last_modified: Option<String>,
    /// Whether the repository is private, when the listing says.
    pub private: Option<bool>,
}

/// Allow/ignore patterns with `huggingface_hub`'s semantics (`fnmatch`: `*` also matches `/`;
/// a pattern ending in `/` means everything below that folder).
#[derive(Clone, Debug)]
pub struct PathFilter {
    allow: Option<GlobSet>,
    ignore: Option<GlobSet>,
}

impl PathFilter {
    /// Empty `allow` keeps every file; `ignore` then removes matches.
    pub fn new(allow: &[String], ignore: &[String]) -> Result<Self> {
        Ok(PathFilter { allow: build_set(allow)?, ignore: build_set(ignore)? })
    }

    /// True if `path` is kept.
    pub fn matches(&self, path: &str) -> bool {
        self.allow.as_ref().is_none_or(|s| s.is_match(path)) && !self.ignore.as_ref().is_some_and(|s| s.is_match(path))
    }
}

fn build_set(patterns: &[String]) -> Result<Option<GlobSet>> {
    if patterns.is_empty() {
        return Ok(None);
    }
    let mut b = GlobSetBuilder::new();
    for p in patterns {
        let pat = if p.ends_with('/') { format!("{p}*") } else { p.clone() };
        let glob = GlobBuilder::new(&pat)
            .literal_separator(false)
            .backslash_escape(true)
            .build()
            .map_err(|e| HubError::InvalidPattern { pattern: p.clone(), message: e.kind().to_string() })?;
        b.add(glob);
    }
    b.build().map(Some).map_err(|e| HubError::InvalidPattern { pattern: patterns.join(","), message: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids() {
        assert!(RepoId::parse("gpt2").is_ok());
        assert!(RepoId::parse("Qwen/Qwen3-30B-A3B").is_ok());
        assert_eq!(RepoId::parse("org/name.v1").unwrap().cache_folder(), "models--org--name.v1");
        for bad in ["", "/x", "a/b/c", "a/../b", "a/..", "a b", "--a/b", "a/b--", "a/"] {
            assert!(RepoId::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn revisions_and_paths() {
        assert!(check_revision("main").is_ok());
        assert!(check_revision("refs/pr/1").is_ok());
        for bad in ["", "../x", "a//b", "/abs", "a/"] {
            assert!(check_revision(bad).is_err(), "{bad}");
        }
        assert!(is_safe_repo_path("a/b.safetensors"));
        for bad in ["", "/etc/passwd", "a/../../x", "./a", "a//b", "a\\b"] {
            assert!(!is_safe_repo_path(bad), "{bad}");
        }
        assert!(is_commit_sha(&"a".repeat(40)));
        assert!(!is_commit_sha(&"A".repeat(40)));
        assert!(!is_commit_sha("main"));
    }

    #[test]
    fn filter_like_fnmatch() {
        let f = PathFilter::new(&["*.safetensors".into(), "*.json".into()], &["*/optimizer*".into()]).unwrap();
        assert!(f.matches("model-00001-of-00002.safetensors"));
        assert!(f.matches("sub/dir/x.safetensors"), "`*` crosses `/` as in fnmatch");
        assert!(f.matches("config.json"));
        assert!(!f.matches("pytorch_model.bin"));
        assert!(!f.matches("ckpt/optimizer.safetensors"));
        let d = PathFilter::new(&["tokenizer/".into()], &[]).unwrap();
        assert!(d.matches("tokenizer/vocab.json"));
        assert!(!d.matches("config.json"));
        assert!(PathFilter::new(&[], &[]).unwrap().matches("anything"));
        assert!(PathFilter::new(&["[".into()], &[]).is_err());
    }
}
