//! Measuring a work directory: the directories under `runs/` and `cache/objects/`, and the
//! sizes of the other directories that matter. Sizes are the apparent bytes of regular files
//! (symlinks are not followed, so a Hub snapshot's links count nothing); a file that vanishes
//! while it is measured counts nothing. Blocking.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};

use super::decide::{DirInfo, Inventory};

/// `<work>/runs`: one directory per run, named after it.
pub fn runs_root(work: &Path) -> PathBuf {
    work.join("runs")
}

/// `<work>/cache/objects`: object-store downloads (`<key>`, `<key>.partial`, `<key>.lock`).
pub fn objects_root(work: &Path) -> PathBuf {
    work.join("cache").join("objects")
}

/// `path` with its symbolic links resolved when it exists (as given otherwise): the store has
/// paths as the submitter spelt them, a worker's state directory may reach them otherwise.
pub fn resolved(path: &Path) -> PathBuf {
    fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The bytes of the regular files under `path` (or of `path`, a file). Missing: 0.
pub fn bytes_under(path: &Path) -> u64 {
    let Ok(meta) = fs::symlink_metadata(path) else { return 0 };
    if !meta.is_dir() {
        return if meta.is_file() { meta.len() } else { 0 };
    }
    let mut total = 0u64;
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else { continue };
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.is_file() {
                total = total.saturating_add(meta.len());
            }
        }
    }
    total
}

fn modified(path: &Path) -> DateTime<Utc> {
    fs::symlink_metadata(path).and_then(|m| m.modified()).map(DateTime::<Utc>::from).unwrap_or_else(|_| Utc::now())
}

/// The directories directly under `parent`, sorted (none when it does not exist).
pub fn subdirectories(parent: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(parent) else { return Vec::new() };
    let mut dirs: Vec<PathBuf> =
        entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| e.path()).collect();
    dirs.sort();
    dirs
}

/// The lock file of a download directory (`<key>` or `<key>.partial`): `<key>.lock`, the one
/// `hf.download` holds while it fills the directory.
pub fn lock_path(download: &Path) -> PathBuf {
    let name = download.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let key = name.strip_suffix(".partial").unwrap_or(&name);
    download.with_file_name(format!("{key}.lock"))
}

/// Whether another process holds the download's lock now (an existing lock file only; the
/// lock is released at once).
pub fn lock_held(download: &Path) -> bool {
    let Ok(file) = fs::OpenOptions::new().write(true).open(lock_path(download)) else { return false };
    matches!(file.try_lock(), Err(fs::TryLockError::WouldBlock))
}

fn dir_info(path: PathBuf, locked: bool) -> DirInfo {
    DirInfo { bytes: bytes_under(&path), modified: modified(&path), locked, path }
}

/// The names of the run directories under `work` (cheap: no sizes).
pub fn run_names(work: &Path) -> Vec<String> {
    subdirectories(&runs_root(work))
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect()
}

/// Measures `work`: its run directories, its downloads, and each of `wanted` (cache entries'
/// and live runs' directories) that is inside it and exists.
pub fn inventory(work: &Path, wanted: &[PathBuf]) -> Inventory {
    let runs = subdirectories(&runs_root(work)).into_iter().map(|p| dir_info(p, false)).collect();
    let downloads = subdirectories(&objects_root(work))
        .into_iter()
        .map(|p| {
            let locked = lock_held(&p);
            dir_info(p, locked)
        })
        .collect();
    let mut sizes = BTreeMap::new();
    for p in wanted {
        if p.starts_with(work) && !sizes.contains_key(p) && fs::symlink_metadata(p).is_ok() {
            sizes.insert(p.clone(), bytes_under(p));
        }
    }
    Inventory { runs, downloads, sizes }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_count_regular_files_and_never_follow_links() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let d = tmp.path().join("a");
        fs::create_dir_all(d.join("b/c")).expect("dirs");
        fs::write(d.join("x"), vec![0u8; 1000]).expect("x");
        fs::write(d.join("b/c/y"), vec![0u8; 24]).expect("y");
        let outside = tmp.path().join("big");
        fs::write(&outside, vec![0u8; 5000]).expect("big");
        std::os::unix::fs::symlink(&outside, d.join("link")).expect("link");
        assert_eq!(bytes_under(&d), 1024);
        assert_eq!(bytes_under(&d.join("x")), 1000);
        assert_eq!(bytes_under(&tmp.path().join("missing")), 0);
    }

    #[test]
    fn paths_are_resolved_through_symlinks_when_they_exist() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let real = tmp.path().join("real");
        fs::create_dir_all(real.join("work/runs/r")).expect("dirs");
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&real, &link).expect("link");
        let real = fs::canonicalize(&real).expect("canonical");
        assert_eq!(resolved(&link.join("work/runs/r")), real.join("work/runs/r"));
        assert_eq!(resolved(&link.join("missing")), link.join("missing"), "as given when it does not exist");
    }

    #[test]
    fn a_held_download_lock_is_seen() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let partial = tmp.path().join("k1.partial");
        fs::create_dir_all(&partial).expect("partial");
        assert_eq!(lock_path(&partial), tmp.path().join("k1.lock"));
        assert!(!lock_held(&partial), "no lock file: not held");
        let lock = fs::File::create(tmp.path().join("k1.lock")).expect("lock file");
        assert!(!lock_held(&partial));
        lock.lock().expect("lock");
        assert!(lock_held(&partial));
        assert!(lock_held(&tmp.path().join("k1")));
        drop(lock);
        assert!(!lock_held(&partial));
    }
}
