//! Carrying out the gc's decisions: each freed item deleted, each check made again at the last
//! moment.
//!
//! - A step cache entry's rows go first, each only if unused since the gc read it
//!   (`Store::cache_forget`); then its directory. A row used meanwhile keeps the directory: no
//!   run is ever served a directory this gc deleted.
//! - An object-store download is deleted holding its lock, the one `hf.download` holds while it
//!   fills it: a download in progress keeps it, and one that starts meanwhile waits and finds it
//!   gone.
//! - A run's work directory is deleted only if its run is still finished, and never the
//!   directories cut out of it (`Item::except`).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use shardline_store::{RunId, Store};

use super::decide::{Action, Item, ItemKind};
use super::measure;

/// What became of an item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Deleted.
    Freed,
    /// A dry run: would be deleted.
    WouldFree,
    /// Kept, as decided.
    Kept,
    /// Was to be freed; kept after all, and why.
    Spared(String),
}

/// Applies the decisions (`dry_run`: none); one outcome per item, in order. Caches and
/// downloads go first, so that a run's directory whose cut-out cache entries were freed too
/// goes whole.
pub async fn apply(store: &Store, items: &[Item], dry_run: bool) -> Vec<Outcome> {
    let mut out = vec![Outcome::Kept; items.len()];
    let runs_last = |i: &usize| matches!(items[*i].kind, ItemKind::Run { .. });
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(runs_last);
    for i in order {
        let item = &items[i];
        out[i] = match item.action {
            Action::Keep => Outcome::Kept,
            Action::Free if dry_run => Outcome::WouldFree,
            Action::Free => free(store, item).await,
        };
    }
    out
}

async fn free(store: &Store, item: &Item) -> Outcome {
    match &item.kind {
        ItemKind::Cache { keys, download } => {
            for (key, uses) in keys {
                match store.cache_forget(key, *uses).await {
                    Ok(true) => {}
                    Ok(false) => return Outcome::Spared("used since the gc looked".into()),
                    Err(e) => return Outcome::Spared(format!("forgetting its cache row failed: {e}")),
                }
            }
            blocking(item.path.clone(), Vec::new(), *download).await
        }
        ItemKind::Download { .. } => blocking(item.path.clone(), Vec::new(), true).await,
        ItemKind::Run { run } => {
            if let Some(run) = run {
                if let Some(why) = became_live(store, *run).await {
                    return Outcome::Spared(why);
                }
            }
            // What was cut out and freed meanwhile no longer holds the directory back.
            let except = item.except.iter().filter(|p| p.symlink_metadata().is_ok()).cloned().collect();
            blocking(item.path.clone(), except, false).await
        }
        ItemKind::Part => Outcome::Kept,
    }
}

async fn became_live(store: &Store, run: RunId) -> Option<String> {
    match store.get_run(run).await {
        Ok(Some(r)) if !r.state.is_terminal() => Some(format!("run {run} is {} again", r.state)),
        Ok(_) => None,
        Err(e) => Some(format!("reading run {run} failed: {e}")),
    }
}

async fn blocking(path: PathBuf, except: Vec<PathBuf>, download: bool) -> Outcome {
    let done = tokio::task::spawn_blocking(move || {
        if download {
            remove_download(&path)
        } else {
            remove_except(&path, &except).map(|()| None)
        }
    })
    .await;
    match done {
        Ok(Ok(None)) => Outcome::Freed,
        Ok(Ok(Some(why))) => Outcome::Spared(why),
        Ok(Err(e)) => Outcome::Spared(format!("deleting failed: {e}")),
        Err(e) => Outcome::Spared(format!("deleting failed: {e}")),
    }
}

/// Deletes a download holding its lock; `Some(why)` when the lock is held by a download.
fn remove_download(path: &Path) -> io::Result<Option<String>> {
    let lock = fs::OpenOptions::new().create(true).truncate(false).write(true).open(measure::lock_path(path))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => return Ok(Some("a download is filling it".into())),
        Err(fs::TryLockError::Error(e)) => return Err(e),
    }
    // The lock file itself stays: a download waiting on it must lock the file the next one finds.
    remove_except(path, &[])?;
    Ok(None)
}

/// Deletes `path` except the paths of `keep` inside it (and the directories leading to them).
/// What is already gone counts as deleted.
pub fn remove_except(path: &Path, keep: &[PathBuf]) -> io::Result<()> {
    let gone = |e: io::Error| if e.kind() == io::ErrorKind::NotFound { Ok(()) } else { Err(e) };
    if keep.iter().any(|k| k == path) {
        return Ok(());
    }
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) => return gone(e),
    };
    if !meta.is_dir() {
        return fs::remove_file(path).or_else(gone);
    }
    if !keep.iter().any(|k| k.starts_with(path)) {
        return fs::remove_dir_all(path).or_else(gone);
    }
    for entry in fs::read_dir(path)? {
        remove_except(&entry?.path(), keep)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remove_except_keeps_the_cut_out_directories_and_their_parents() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let run = tmp.path().join("run");
        for d in ["shard/checkpoint", "shard/checkpoint.partial", "validate", "cmd/out"] {
            fs::create_dir_all(run.join(d)).expect("dir");
        }
        fs::write(run.join("shard/checkpoint/__0_0.distcp"), b"data").expect("file");
        fs::write(run.join("shard/plan.json"), b"{}").expect("file");
        fs::write(run.join("cmd/out/result.json"), b"{}").expect("file");
        fs::write(run.join("top.txt"), b"x").expect("file");
        remove_except(&run, &[run.join("shard/checkpoint"), run.join("cmd/out")]).expect("remove");
        assert!(run.join("shard/checkpoint/__0_0.distcp").exists());
        assert!(run.join("cmd/out/result.json").exists());
        assert!(!run.join("shard/plan.json").exists());
        assert!(!run.join("shard/checkpoint.partial").exists());
        assert!(!run.join("validate").exists());
        assert!(!run.join("top.txt").exists());
        remove_except(&run, &[]).expect("remove all");
        assert!(!run.exists());
        remove_except(&run, &[]).expect("gone already");
    }

    #[test]
    fn a_download_being_filled_is_spared() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("cache/objects/k1");
        fs::create_dir_all(&dir).expect("dir");
        let held = fs::File::create(tmp.path().join("cache/objects/k1.lock")).expect("lock");
        held.lock().expect("lock");
        assert_eq!(remove_download(&dir).expect("checked"), Some("a download is filling it".into()));
        assert!(dir.exists());
        drop(held);
        assert_eq!(remove_download(&dir).expect("removed"), None);
        assert!(!dir.exists());
        assert!(tmp.path().join("cache/objects/k1.lock").exists(), "the lock file stays");
    }
}
