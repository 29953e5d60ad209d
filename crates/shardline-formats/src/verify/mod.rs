//! `validate`: proves a written checkpoint loads and is bit-exact against its source release, in
//! memory that does not grow with the number of chunks.
//!
//! `.metadata` is streamed once by the strict reader. Each entry is checked as it arrives: its key
//! against the release, its chunks for exact tiling of the global shape, and their boxes summed
//! into a fingerprint ([`keys::BoxSet`]). Each `storage_data` item is handed to a pool of threads
//! that read it as torch does (the archive, `data.pkl`), record the box it holds and compare its
//! bytes with the release's mapping of that box, streamed piece by piece. At the end every key's
//! declared boxes must equal the boxes its items hold: each chunk stored exactly once. What grows
//! with the checkpoint is one small record per key, never one per chunk.
//!
//! A validation can be split across workers by the files items are stored in ([`Scope`]): each
//! part checks its files' items and returns the fingerprint of the boxes they hold; a pass over
//! `.metadata` alone returns the fingerprint declared, which the parts' must add up to
//! ([`parts_agree`]). The release bytes a part compares with are listed by [`part_ranges`].

mod items;
mod keys;
mod objects;
mod parts;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};

use shardline_layout::Plan;
use thiserror::Error;

use crate::checkpoint::{open_checkpoint, CheckpointError};
use crate::dcp_metadata::{read_metadata_file, DcpMetadataError, EntryMeta, MetadataItem};
use crate::execute::{ExecuteError, Progress, SourceMap};
use crate::safetensors::Release;
use items::{Job, Location, Worker};
pub use keys::BoxSet;
use keys::Keys;
pub use parts::{part_ranges, parts_agree};

/// One finding: the key and what is wrong, with offsets and shapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub key: String,
    pub message: String,
}

/// The outcome of validation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Tensors whose every chunk was compared with the release.
    pub tensors: u64,
    /// Stored items read (chunks and bytes items).
    pub items: u64,
    pub bytes_checked: u64,
    pub findings: Vec<Finding>,
    /// Findings past the ones kept.
    pub findings_dropped: u64,
    /// The boxes of every chunk `.metadata` declares.
    pub declared: BoxSet,
    /// The boxes the items read hold (all of them unless the scope is a part).
    pub held: BoxSet,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.findings.is_empty() && self.findings_dropped == 0
    }
}

/// Errors that stop validation (as opposed to findings, which are reported).
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum VerifyError {
    #[error("{path}: {action}: {error}")]
    Io { path: PathBuf, action: &'static str, error: std::io::Error },
    #[error(transparent)]
    Execute(#[from] ExecuteError),
    #[error("{path}: {source}")]
    Metadata { path: PathBuf, source: DcpMetadataError },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

/// Items per message to the checking threads.
const JOB_BATCH: usize = 256;

/// Findings kept from the metadata pass.
const MAX_FINDINGS: usize = 1000;

/// How [`verify_checkpoint`] runs.
#[derive(Clone, Debug)]
pub struct VerifyOptions<'a> {
    /// The expected keys under this prefix (optimizer state) may be absent all together, but
    /// not in part.
    pub optional_prefix: Option<&'a str>,
    /// Threads that check items (at least 1): a worker passes the CPUs its task leased.
    pub threads: usize,
    /// What is read: everything unless the validation is split.
    pub scope: Scope<'a>,
}

/// Which part of a checkpoint's validation a call does.
#[derive(Clone, Copy, Debug, Default)]
pub enum Scope<'a> {
    /// `.metadata` and every stored item, each key's declared and held boxes compared.
    #[default]
    Whole,
    /// `.metadata`'s entries and the items stored in these files only. The report's `held`
    /// counts toward the total the `Declared` pass checks; keys are not compared one by one.
    Files(&'a BTreeSet<String>),
    /// `.metadata` alone: entries, tiling, missing keys, and the `declared` fingerprint.
    Declared,
}

impl Scope<'_> {
    /// Whether items stored in `file` are read.
    fn reads(&self, file: &str) -> bool {
        match self {
            Scope::Whole => true,
            Scope::Files(files) => files.contains(file),
            Scope::Declared => false,
        }
    }
}

impl Default for VerifyOptions<'_> {
    /// No optional keys; a thread per core, up to 8 (past that the disk is the limit).
    fn default() -> Self {
        Self {
            optional_prefix: None,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(1, 8),
            scope: Scope::Whole,
        }
    }
}

/// Validates the checkpoint in `dir` (DCP or DCP-safetensors) against `release`, whose expected
/// tensors are described by `reference` (a plan of the release without vocab padding; any mesh:
/// global tensors do not depend on it).
pub fn verify_checkpoint(
    dir: &Path,
    release: &Release,
    reference: &Plan,
    options: &VerifyOptions<'_>,
    progress: &Progress,
) -> Result<VerifyReport, VerifyError> {
    let sources = SourceMap::new(reference, release)?;
    let threads = options.threads.max(1);
    let (tx, rx) = sync_channel::<Vec<Job>>(4 * threads);
    let rx = Mutex::new(rx);
    let mut keys = Keys::new(reference);
    let mut findings = Vec::new();
    let (workers, fed) = std::thread::scope(|s| {
        let pool: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut w = Worker::new(dir, &sources, progress);
                    loop {
                        // A poisoned lock means another worker panicked: stop too.
                        let job = match rx.lock() {
                            Ok(r) => r.recv(),
                            Err(_) => break,
                        };
                        match job {
                            Ok(jobs) => {
                                for job in jobs {
                                    w.check(job)?;
                                }
                            }
                            Err(_) => break,
                        }
                    }
                    Ok::<_, VerifyError>(w)
                })
            })
            .collect();
        // Jobs go in batches: one channel message per item would cost more than checking it.
        let mut batch = Vec::with_capacity(JOB_BATCH);
        let fed = feed(dir, &mut keys, &mut findings, options.scope, |job| {
            batch.push(job);
            batch.len() < JOB_BATCH || tx.send(std::mem::replace(&mut batch, Vec::with_capacity(JOB_BATCH))).is_ok()
        });
        if !batch.is_empty() {
            // Workers that stopped early report why when joined.
            let _ = tx.send(batch);
        }
        drop(tx);
        let workers: Vec<_> = pool.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(worker_panicked()))).collect();
        (workers, fed)
    });
    let mut found: Vec<BoxSet> = vec![BoxSet::default(); keys.infos.len()];
    let mut report = VerifyReport { findings, ..VerifyReport::default() };
    for w in workers {
        let w = w?;
        report.bytes_checked += w.bytes;
        report.findings.extend(w.findings);
        report.findings_dropped += w.findings_dropped;
        for (held, b) in found.iter_mut().zip(w.found) {
            held.merge(b);
        }
    }
    fed?;
    for (info, declared) in keys.infos.iter().zip(&keys.declared) {
        let held = found.get(info.index as usize).copied().unwrap_or_default();
        report.declared.merge(*declared);
        report.held.merge(held);
        if !matches!(options.scope, Scope::Whole) {
            continue;
        }
        report.items += held.count;
        if held != *declared {
            report.findings.push(Finding {
                key: info.fqn.clone(),
                message: format!(
                    "its {} stored item(s) do not hold exactly the {} chunk(s) .metadata declares",
                    held.count, declared.count
                ),
            });
        } else if info.want.is_some() {
            report.tensors += 1;
        }
    }
    match options.scope {
        Scope::Whole => {}
        Scope::Files(_) => report.items = report.held.count,
        Scope::Declared => report.tensors = keys.infos.iter().filter(|i| i.want.is_some()).count() as u64,
    }
    if !matches!(options.scope, Scope::Files(_)) {
        for key in keys.missing(options.optional_prefix) {
            report.findings.push(Finding { key, message: "missing from the checkpoint".into() });
        }
        for (key, message) in objects::extra_state_gaps(keys.by_name.keys().map(String::as_str)) {
            report.findings.push(Finding { key, message });
        }
    }
    report.findings.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(report)
}

fn worker_panicked() -> VerifyError {
    VerifyError::Io {
        path: PathBuf::new(),
        action: "validate",
        error: std::io::Error::other("a worker thread panicked"),
    }
}

/// Streams the checkpoint's entries into `keys` and its items to `send` (false: the workers
/// stopped).
fn feed(
    dir: &Path,
    keys: &mut Keys<'_>,
    findings: &mut Vec<Finding>,
    scope: Scope<'_>,
    mut send: impl FnMut(Job) -> bool,
) -> Result<(), VerifyError> {
    let find = |findings: &mut Vec<Finding>, key: &str, message: String| {
        if findings.len() < MAX_FINDINGS {
            findings.push(Finding { key: key.to_string(), message });
        }
    };
    let md_path = dir.join(".metadata");
    if !md_path.is_file() {
        // DCP-sharded safetensors: small headers, read whole.
        let ckpt = open_checkpoint(dir)?;
        for t in ckpt.tensors {
            let chunks: Vec<_> = t.chunks.iter().map(|c| (c.offsets.clone(), c.sizes.clone())).collect();
            for p in keys.tensor_entry(t.key.clone(), t.dtype, t.shape, &chunks) {
                find(findings, &t.key, p);
            }
            let Some(info) = keys.infos.last().cloned() else { continue };
            for c in t.chunks.into_iter().filter(|c| scope.reads(&c.file)) {
                let job = Job {
                    key: info.clone(),
                    offsets: Some(c.offsets),
                    file: c.file.clone(),
                    location: Location::Raw { data_offset: c.data_offset, sizes: c.sizes },
                };
                if !send(job) {
                    return Ok(());
                }
            }
        }
        return Ok(());
    }
    let mut files: HashMap<String, Arc<str>> = HashMap::new();
    let mut stopped = false;
    let result = read_metadata_file(&md_path, |item| {
        match item {
            MetadataItem::Entry(fqn, EntryMeta::Bytes) => keys.bytes_entry(fqn),
            MetadataItem::Entry(fqn, EntryMeta::Tensor { dtype, size, chunks }) => {
                let chunks: Vec<_> = chunks.into_iter().map(|c| (c.offsets, c.sizes)).collect();
                let problems = keys.tensor_entry(fqn.clone(), dtype, size, &chunks);
                for p in problems {
                    find(findings, &fqn, p);
                }
            }
            MetadataItem::PlannerPath(..) => {}
            MetadataItem::Storage(key, info) => {
                let Some(&index) = keys.by_name.get(&key.fqn) else {
                    find(findings, &key.fqn, "a storage_data item for a key .metadata does not declare".into());
                    return Ok(());
                };
                if info.transform_descriptors.as_ref().is_some_and(|t| !t.is_empty()) {
                    let message = format!(
                        "stored with transforms {:?}, which validate does not undo",
                        info.transform_descriptors
                    );
                    find(findings, &key.fqn, message);
                    return Ok(());
                }
                if !is_plain_file_name(&info.relative_path) {
                    find(
                        findings,
                        &key.fqn,
                        format!("storage file name {:?} escapes the checkpoint directory", info.relative_path),
                    );
                    return Ok(());
                }
                if stopped || !scope.reads(&info.relative_path) {
                    return Ok(());
                }
                let file =
                    files.entry(info.relative_path.clone()).or_insert_with(|| Arc::from(info.relative_path.as_str()));
                let job = Job {
                    key: keys.infos[index as usize].clone(),
                    offsets: key.offset,
                    file: file.clone(),
                    location: Location::Archive { offset: info.offset, length: info.length },
                };
                stopped = !send(job);
            }
        }
        Ok::<(), DcpMetadataError>(())
    });
    result.map(|_| ()).map_err(|source| VerifyError::Metadata { path: md_path, source })
}

/// A file name inside the checkpoint directory: one normal component.
fn is_plain_file_name(name: &str) -> bool {
    let p = Path::new(name);
    let mut parts = p.components();
    matches!((parts.next(), parts.next()), (Some(std::path::Component::Normal(_)), None))
}
