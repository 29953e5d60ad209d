//! Output directories as the writers create them: a failed write leaves nothing behind, not even
//! a directory it created (or the parents it created for it), and a directory replaced whole is
//! withdrawn in one step so that no reader ever sees half of the old one and half of the new.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

/// The directories [`create`] made, deepest first, to remove on failure.
#[derive(Debug, Default)]
#[must_use = "call `remove` on failure, or drop it on success"]
pub struct Created(Vec<PathBuf>);

/// Creates `dir` and any missing parents, remembering which it made.
pub fn create(dir: &Path) -> io::Result<Created> {
    let mut missing = Vec::new();
    let mut at = Some(dir);
    while let Some(p) = at.filter(|p| !p.as_os_str().is_empty() && !p.exists()) {
        missing.push(p.to_path_buf());
        at = p.parent();
    }
    fs::create_dir_all(dir)?;
    Ok(Created(missing))
}

impl Created {
    /// Removes the directories this call created, deepest first, each only if empty (what the
    /// writer made in them is its own to remove first).
    pub fn remove(self) {
        for d in &self.0 {
            if fs::remove_dir(d).is_err() {
                break;
            }
        }
    }

    /// Whether the directory itself was made by [`create`].
    pub fn made_it(&self) -> bool {
        !self.0.is_empty()
    }
}

/// Puts the finished directory `staged` at `out` (a sibling on the same file system). An
/// existing `out` is first renamed aside in one step (so readers see the old directory whole,
/// then nothing, then the new one whole), then removed. The parent is synced.
pub fn replace_with(staged: &Path, out: &Path) -> io::Result<()> {
    let aside = sibling(out, "old");
    let had_old = match fs::rename(out, &aside) {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => return Err(e),
    };
    if let Err(e) = fs::rename(staged, out) {
        if had_old {
            let _ = fs::rename(&aside, out);
        }
        return Err(e);
    }
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        File::open(parent).and_then(|d| d.sync_all())?;
    }
    if had_old {
        fs::remove_dir_all(&aside)?;
    }
    Ok(())
}

/// A hidden sibling of `out` for staging (`.NAME.shardline-WHAT`).
pub fn sibling(out: &Path, what: &str) -> PathBuf {
    let name = out.file_name().map_or_else(|| "out".into(), |n| n.to_string_lossy().into_owned());
    out.with_file_name(format!(".{name}.shardline-{what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_parents_are_removed_and_existing_ones_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("a/b/c");
        let created = create(&out).unwrap();
        assert!(out.is_dir() && created.made_it());
        created.remove();
        assert!(!tmp.path().join("a").exists(), "a parent the write created was left");
        assert!(tmp.path().is_dir());
        // An existing directory is not the writer's to remove.
        let created = create(tmp.path()).unwrap();
        assert!(!created.made_it());
        created.remove();
        assert!(tmp.path().is_dir());
    }

    #[test]
    fn replacing_withdraws_the_old_directory_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("export");
        fs::create_dir(&out).unwrap();
        fs::write(out.join("old.safetensors"), b"old").unwrap();
        let staged = sibling(&out, "partial");
        fs::create_dir(&staged).unwrap();
        fs::write(staged.join("new.safetensors"), b"new").unwrap();
        replace_with(&staged, &out).unwrap();
        assert_eq!(fs::read(out.join("new.safetensors")).unwrap(), b"new");
        assert!(!out.join("old.safetensors").exists());
        assert!(!staged.exists() && !sibling(&out, "old").exists());
    }
}
