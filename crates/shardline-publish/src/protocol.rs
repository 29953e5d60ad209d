//! The publish protocol, step by step (the crate documentation says why each step is there):
//! plan against what the destination vouches for, record the publish, withdraw the old commit,
//! write the data, then the commit markers, then the manifest.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures_util::stream::{self, StreamExt};
use object_store::{ObjectStoreExt, PutPayload};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use crate::commit::{withdraw, CommitRule};
use crate::engine::{
    complete_staged, get_bytes, hash_sources, head, process, remove_local_staging, store_err, sync_local,
    sync_local_dir, Ctx, Outcome, Pending, Plan, HEADS_IN_FLIGHT, PENDING_FORMAT,
};
use crate::{
    source_files, Destination, FileEntry, Manifest, PublishError, PublishOptions, PublishReport, MANIFEST,
    MANIFEST_FORMAT, PENDING,
};

/// What the destination vouches for: its manifest's entries, or else those an interrupted
/// publish's record still trusts, and the paths such a publish set out to write.
struct Vouched {
    previous: Option<Manifest>,
    trusted: BTreeMap<String, FileEntry>,
    touched: BTreeSet<String>,
}

async fn vouched(dest: &Destination) -> Result<Vouched, PublishError> {
    // An unreadable manifest vouches for nothing (and is replaced).
    let previous: Option<Manifest> = match get_bytes(dest, MANIFEST).await? {
        Some(b) => serde_json::from_slice(&b).ok(),
        None => None,
    };
    let pending: Option<Pending> = if previous.is_some() {
        None
    } else {
        get_bytes(dest, PENDING).await?.and_then(|b| serde_json::from_slice(&b).ok())
    };
    let (trusted, touched) = match (&previous, pending) {
        (Some(m), _) => (m.files.iter().map(|f| (f.path.clone(), f.clone())).collect(), BTreeSet::new()),
        (None, Some(p)) => {
            (p.trusted.into_iter().map(|f| (f.path.clone(), f)).collect(), p.touching.into_iter().collect())
        }
        (None, None) => (BTreeMap::new(), BTreeSet::new()),
    };
    Ok(Vouched { previous, trusted, touched })
}

/// What to do with each file: what the destination vouches for is confirmed with a HEAD; the
/// rest is uploaded or looked at more closely.
async fn plan_files(ctx: &Ctx<'_>, entries: &[FileEntry], v: &Vouched) -> Result<Vec<Plan>, PublishError> {
    stream::iter(entries.iter())
        .map(|entry| {
            let vouched = v.trusted.get(&entry.path);
            let untouched = !v.touched.contains(&entry.path);
            async move {
                match vouched {
                    Some(t) if untouched && t == entry => Ok(match head(ctx.dest, &entry.path).await? {
                        Some(h) if h.size == entry.size && h.sha256.as_ref().is_none_or(|s| *s == entry.sha256) => {
                            Plan::Skip
                        }
                        _ => Plan::Upload,
                    }),
                    Some(_) if untouched => Ok(Plan::Upload),
                    _ => Ok(Plan::Check),
                }
            }
        })
        .buffered(HEADS_IN_FLIGHT)
        .collect::<Vec<Result<Plan, PublishError>>>()
        .await
        .into_iter()
        .collect()
}

/// Writes every file not skipped: the data files several at once (DCP-safetensors files left
/// open and then completed together), and only then the commit markers, one after the other.
async fn write_files(
    ctx: &Ctx<'_>,
    entries: &[FileEntry],
    plans: &[Plan],
    rule: &CommitRule,
) -> Result<BTreeMap<usize, Outcome>, PublishError> {
    let data: Vec<(usize, Plan)> = plans
        .iter()
        .copied()
        .enumerate()
        .filter(|(i, p)| *p != Plan::Skip && !rule.is_marker(&entries[*i].path))
        .collect();
    let mut results: Vec<(usize, Result<Outcome, PublishError>)> = stream::iter(data)
        .map(|(i, plan)| async move {
            let entry = &entries[i];
            let r = process(ctx, entry, plan, rule.completes_together(&entry.path)).await;
            if r.is_err() {
                ctx.failed.store(true, Ordering::Relaxed);
            }
            (i, r)
        })
        .buffer_unordered(ctx.opts.max_files_in_flight)
        .collect()
        .await;
    results.sort_by_key(|(i, _)| *i);
    let mut outcomes = BTreeMap::new();
    let mut first_error = None;
    for (i, r) in results {
        match r {
            Ok(o) => {
                outcomes.insert(i, o);
            }
            Err(PublishError::Cancelled) => {}
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_error {
        // Dropping the outcomes aborts the uploads still open.
        return Err(e);
    }
    // Uploads left open (DCP-safetensors) are completed together, now that every file is up.
    let mut staged = Vec::new();
    for (i, o) in std::mem::take(&mut outcomes) {
        match o {
            Outcome::Staged { parts, upload } => staged.push((i, &entries[i], parts, upload)),
            done => {
                outcomes.insert(i, done);
            }
        }
    }
    outcomes.extend(complete_staged(ctx, staged).await?);
    for (i, plan) in plans.iter().copied().enumerate() {
        if plan != Plan::Skip && rule.is_marker(&entries[i].path) {
            outcomes.insert(i, process(ctx, &entries[i], plan, false).await?);
        }
    }
    Ok(outcomes)
}

/// Writes the manifest and reads it back; a wrong one is deleted.
async fn commit_manifest(ctx: &Ctx<'_>, bytes: &[u8]) -> Result<(), PublishError> {
    let dest = ctx.dest;
    dest.store
        .put(&dest.object(MANIFEST), PutPayload::from(bytes.to_vec()))
        .await
        .map_err(|e| store_err(dest, MANIFEST, "write the manifest", e))?;
    let back = get_bytes(dest, MANIFEST).await?;
    if back.as_deref() != Some(bytes) {
        let _ = dest.store.delete(&dest.object(MANIFEST)).await;
        let (actual_size, actual) = match &back {
            Some(b) => (b.len() as u64, hex::encode(Sha256::digest(b))),
            None => (0, "(no object)".into()),
        };
        return Err(PublishError::Verify {
            path: PathBuf::from(format!("{}/{MANIFEST}", dest.display)),
            expected: hex::encode(Sha256::digest(bytes)),
            actual,
            expected_size: bytes.len() as u64,
            actual_size,
        });
    }
    sync_local(ctx, MANIFEST).await
}

/// Publishes the checkpoint in `src` to `dest` (see the crate documentation for the protocol).
pub async fn publish_to(
    dest: &Destination,
    src: &Path,
    source: serde_json::Value,
    layout: serde_json::Value,
    options: &PublishOptions,
) -> Result<(Manifest, PublishReport), PublishError> {
    if options.part_size == 0 || options.max_parts_in_flight == 0 || options.max_files_in_flight == 0 {
        return Err(PublishError::Config(format!(
            "part_size, max_parts_in_flight and max_files_in_flight must be positive: {options:?}"
        )));
    }
    let names = source_files(src)?;
    let entries = hash_sources(src, &names).await?;
    let manifest = Manifest {
        format: MANIFEST_FORMAT.to_string(),
        files: entries.clone(),
        source,
        layout,
        shardline_version: env!("CARGO_PKG_VERSION").to_string(),
    };
    let manifest_bytes = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| PublishError::BadManifest(PathBuf::from(MANIFEST), e.to_string()))?;
    let v = vouched(dest).await?;
    let rule = CommitRule::of(&names);
    let ctx = Ctx {
        dest,
        src,
        opts: options,
        parts: Arc::new(Semaphore::new(options.max_parts_in_flight)),
        failed: AtomicBool::new(false),
    };
    let ctx = &ctx;
    let mut plans = plan_files(ctx, &entries, &v).await?;

    let mut report = PublishReport::default();
    if plans.iter().all(|p| *p == Plan::Skip) {
        report.skipped = names.clone();
        if v.previous.as_ref() == Some(&manifest) {
            // A publish killed after its commit may have left its record behind.
            if head(dest, PENDING).await?.is_some() {
                let _ = crate::engine::delete_if_present(dest, PENDING, "remove a stale publish record").await;
            }
            return Ok((manifest, report));
        }
        // Same files, another manifest (its source or layout changed): the data stays committed.
        commit_manifest(ctx, &manifest_bytes).await?;
        report.manifest_written = true;
        let _ = crate::engine::delete_if_present(dest, PENDING, "remove the record of the publish").await;
        return Ok((manifest, report));
    }

    // What the withdrawal removes is written again.
    let withdrawn = rule.withdrawn(&names, v.trusted.keys().chain(v.touched.iter()));
    for (entry, plan) in entries.iter().zip(plans.iter_mut()) {
        if withdrawn.contains(&entry.path) {
            *plan = Plan::Upload;
        }
    }
    // Record what stays vouched for and what is about to change, then withdraw the commit.
    let writing: BTreeSet<String> = entries
        .iter()
        .zip(&plans)
        .filter(|(_, p)| **p != Plan::Skip)
        .map(|(e, _)| e.path.clone())
        .chain(v.touched.iter().cloned())
        .chain(withdrawn.iter().filter(|n| v.trusted.contains_key(*n)).cloned())
        .collect();
    let record = Pending {
        format: PENDING_FORMAT.to_string(),
        trusted: v.trusted.values().filter(|f| !writing.contains(&f.path)).cloned().collect(),
        touching: writing.into_iter().collect(),
    };
    let record = serde_json::to_vec_pretty(&record).expect("the pending record serializes");
    dest.store
        .put(&dest.object(PENDING), PutPayload::from(record))
        .await
        .map_err(|e| store_err(dest, PENDING, "record the publish in progress", e))?;
    withdraw(dest, &withdrawn).await?;
    sync_local_dir(dest).await?;
    remove_local_staging(dest, &names).await;
    abort_stale_uploads(dest, &names).await;

    let written = match write_files(ctx, &entries, &plans, &rule).await {
        Ok(outcomes) => outcomes,
        Err(e) => {
            // Withdrawn before anything else: whatever this publish made a reader take for a
            // checkpoint (a marker written just before the failure, a completed safetensors file).
            let _ = withdraw(dest, &rule.withdrawn(&names, [].iter())).await;
            return Err(e);
        }
    };
    fill_report(&mut report, &entries, written);
    sync_local_dir(dest).await?;

    if let Err(e) = commit_manifest(ctx, &manifest_bytes).await {
        let _ = withdraw(dest, &rule.withdrawn(&names, [].iter())).await;
        return Err(e);
    }
    report.manifest_written = true;
    // The manifest now vouches for everything; a stale record would be ignored anyway.
    let _ = crate::engine::delete_if_present(dest, PENDING, "remove the record of the publish").await;
    sync_local_dir(dest).await?;
    Ok((manifest, report))
}

/// Aborts the multipart uploads of these files that an earlier, killed publish left open (S3,
/// which lists them): they would otherwise hold storage until the bucket's lifecycle rule. Best
/// effort; a publish owns its destination while it runs.
async fn abort_stale_uploads(dest: &Destination, names: &[String]) {
    let Ok(Some(open)) = dest.open_uploads().await else { return };
    let Some(mp) = dest.multipart() else { return };
    for u in open.into_iter().filter(|u| names.contains(&u.key)) {
        let _ = mp.abort_multipart(&dest.object(&u.key), &u.upload_id).await;
    }
}

fn fill_report(report: &mut PublishReport, entries: &[FileEntry], mut outcomes: BTreeMap<usize, Outcome>) {
    for (i, entry) in entries.iter().enumerate() {
        match outcomes.remove(&i) {
            None => report.skipped.push(entry.path.clone()),
            Some(Outcome::Copied { bytes, parts, verified }) => {
                report.copied.push(entry.path.clone());
                report.bytes_copied += bytes;
                report.parts_uploaded += parts;
                report.bytes_verified += verified;
            }
            Some(Outcome::Resumed { verified }) => {
                report.resumed.push(entry.path.clone());
                report.bytes_verified += verified;
            }
            Some(Outcome::Staged { .. }) => unreachable!("staged uploads are completed before the report"),
        }
    }
}
