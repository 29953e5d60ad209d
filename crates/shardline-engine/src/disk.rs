//! The worker's disk as a resource: the free space of the file system its work directory is on,
//! measured before every claim, and the scratch it offers from it.
//!
//! What a worker offers is the smaller of two figures:
//! - its configured scratch (`--scratch`, a cap) less what its leases hold;
//! - the measured free bytes less its reserve (`--scratch-reserve`) and less what its leases hold.
//!
//! A lease's scratch counts as used from its claim to its end, though its bytes reach the disk
//! only as it writes: while it writes, the part already written is counted twice (once by the
//! measurement, once as its lease's), so the worker offers less than it could, never more. Two
//! leases can therefore never both count on the same free bytes. Once a lease ends, what its task
//! left on the disk (rank files are outputs) is in the measurement alone.

use std::io;
use std::path::{Path, PathBuf};

use shardline_store::{Resources, Store, WorkerDisk, WorkerId};

/// What a worker keeps free on its disk by default: room for logs, the job store of an embedded
/// deployment, and the file system's own needs, so that a task never fills the disk to the last
/// byte.
pub const DEFAULT_SCRATCH_RESERVE: u64 = 1 << 30;

/// Where a worker measures its disk, and what it keeps free there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskSettings {
    /// The work directory (or a directory on the same file system); it need not exist yet: its
    /// nearest existing ancestor is measured.
    pub dir: PathBuf,
    /// Bytes never offered as scratch.
    pub reserve: u64,
}

/// A file system's space as measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskSpace {
    /// Bytes available to unprivileged writers (`f_bavail` blocks).
    pub free: u64,
    /// Bytes of the file system (`f_blocks`).
    pub total: u64,
}

/// Measures the file system holding `dir` (its nearest existing ancestor).
pub fn measure(dir: &Path) -> io::Result<DiskSpace> {
    let at = dir.ancestors().find(|a| !a.as_os_str().is_empty() && a.exists()).unwrap_or(Path::new("."));
    let s = rustix::fs::statvfs(at).map_err(io::Error::from)?;
    Ok(DiskSpace { free: s.f_bavail.saturating_mul(s.f_frsize), total: s.f_blocks.saturating_mul(s.f_frsize) })
}

/// The scratch a worker offers to a claim: `unleased` (its configured scratch less what its
/// leases hold, `leased`), and no more than the measured free bytes less `reserve` and `leased`.
/// Unmeasured (`None`): `unleased`.
pub fn offered_scratch(unleased: u64, leased: u64, disk: Option<DiskSpace>, reserve: u64) -> u64 {
    match disk {
        Some(d) => unleased.min(d.free.saturating_sub(reserve).saturating_sub(leased)),
        None => unleased,
    }
}

/// What a worker offers now: its free resources (`free`, out of `cap` configured scratch), the
/// scratch limited by its disk when it measures one, with the measurement. A disk that cannot be
/// measured offers no scratch (tasks that need none still run): a full disk and an unreadable
/// one look alike from here.
pub(crate) fn offer(free: Resources, cap: u64, settings: Option<&DiskSettings>) -> (Resources, Option<DiskSpace>) {
    let Some(s) = settings else { return (free, None) };
    let leased = cap.saturating_sub(free.scratch);
    match measure(&s.dir) {
        Ok(space) => {
            let scratch = offered_scratch(free.scratch, leased, Some(space), s.reserve);
            (Resources { scratch, ..free }, Some(space))
        }
        Err(e) => {
            tracing::warn!("measuring the free space of {} failed: {e}; offering no scratch", s.dir.display());
            (Resources { scratch: 0, ..free }, None)
        }
    }
}

/// Tells the store the worker is alive, with its disk and the scratch it offers when it
/// measures one. Only the dashboard, "why waiting" and the metrics read it: a failure is logged
/// and the next beat tries again.
pub(crate) async fn beat(store: &Store, id: WorkerId, free: Resources, cap: u64, settings: Option<&DiskSettings>) {
    let result = match offer(free, cap, settings) {
        (offered, Some(space)) => {
            let disk = WorkerDisk { free: space.free, total: space.total, scratch_free: offered.scratch };
            store.worker_heartbeat_with_disk(id, &disk).await
        }
        (_, None) => store.worker_heartbeat(id).await,
    };
    if let Err(e) = result {
        tracing::warn!("worker heartbeat failed (will retry): {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_offer_is_the_smaller_of_the_cap_and_the_disk() {
        let disk = |free| Some(DiskSpace { free, total: 100 * GIB });
        // Unlimited cap: the disk decides, less the reserve.
        assert_eq!(offered_scratch(u64::MAX / 4, 0, disk(10 * GIB), GIB), 9 * GIB);
        // A cap below the disk's free space decides.
        assert_eq!(offered_scratch(5 * GIB, 0, disk(10 * GIB), GIB), 5 * GIB);
        // Leases' scratch counts against the disk too (not yet written, or written and counted
        // twice: never offered again).
        assert_eq!(offered_scratch(u64::MAX / 4 - 4 * GIB, 4 * GIB, disk(10 * GIB), GIB), 5 * GIB);
        assert_eq!(offered_scratch(8 * GIB, 2 * GIB, disk(10 * GIB), GIB), 7 * GIB);
        // A full disk, or one below its reserve, offers nothing.
        assert_eq!(offered_scratch(u64::MAX / 4, 0, disk(0), GIB), 0);
        assert_eq!(offered_scratch(u64::MAX / 4, 0, disk(GIB / 2), GIB), 0);
        assert_eq!(offered_scratch(u64::MAX / 4, 3 * GIB, disk(2 * GIB), 0), 0);
        // Unmeasured: the cap less the leases, as configured.
        assert_eq!(offered_scratch(3 * GIB, 2 * GIB, None, GIB), 3 * GIB);
    }

    #[test]
    fn measures_the_nearest_existing_directory() {
        let dir = tempfile::tempdir().expect("temp dir");
        let here = measure(dir.path()).expect("measure");
        assert!(here.total > 0 && here.free <= here.total, "{here:?}");
        // A work directory not made yet is measured where it will be.
        let later = measure(&dir.path().join("work/runs")).expect("measure a missing directory");
        assert_eq!(later.total, here.total);
        // A relative path with no existing part is the current directory's file system.
        assert!(measure(Path::new("no-such-dir/work")).is_ok());
    }

    #[test]
    fn an_offer_limits_only_the_scratch() {
        let dir = tempfile::tempdir().expect("temp dir");
        let free = Resources { cpus: 4, memory: 8 * GIB, gpus: 1, scratch: u64::MAX / 4 };
        let huge = DiskSettings { dir: dir.path().to_path_buf(), reserve: u64::MAX };
        let (offered, space) = offer(free, u64::MAX / 4, Some(&huge));
        assert_eq!(offered, Resources { scratch: 0, ..free }, "a reserve beyond the disk: a full disk");
        assert!(space.is_some());
        let none = DiskSettings { dir: dir.path().to_path_buf(), reserve: 0 };
        let (offered, space) = offer(free, u64::MAX / 4, Some(&none));
        let space = space.expect("measured");
        assert!(offered.scratch <= space.free && offered.scratch > 0, "{offered:?} {space:?}");
        assert_eq!(offer(free, u64::MAX / 4, None), (free, None));
    }
}
