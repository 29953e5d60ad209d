//! What a published location holds: a complete checkpoint (which one), or what an interrupted
//! publish left behind there; and cleaning that debris away.
//!
//! "Complete" means what Shardline's readers require: a manifest whose every file is there with
//! its size. A location without one is not a checkpoint to Shardline; whether torch would still
//! take it for one (`.metadata` present) is reported, because that is the dangerous case.
//! Only what a publish of ours writes is ever called debris or removed: the pending record, the
//! files it names, the commit markers it stands for, the local file system's staging files of
//! unfinished uploads (`NAME#N`), and S3's open multipart uploads under the prefix.

use std::collections::{BTreeMap, BTreeSet};

use futures_util::stream::TryStreamExt;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::commit::{DCP_METADATA, HF_INDEX};
use crate::engine::{delete_if_present, get_bytes, store_err, Pending};
use crate::{Backend, Destination, Manifest, PublishError, MANIFEST, PENDING};

/// What a location is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LocationState {
    /// A manifest, and every file it lists, with its size.
    Complete,
    /// Something is there, but not a complete checkpoint.
    Incomplete,
    /// Nothing is there.
    Empty,
}

/// The answer of [`survey`] (and of [`clean`]).
#[derive(Clone, Debug, Serialize)]
pub struct LocationReport {
    pub url: String,
    pub state: LocationState,
    /// SHA-256 of the manifest's bytes, when complete: which checkpoint this is.
    pub manifest_sha256: Option<String>,
    /// Whether `.metadata` is there, so that torch's DCP reader takes the location for a
    /// checkpoint (dangerous when it is not complete).
    pub torch_visible: bool,
    /// Objects listed under the location.
    pub files: usize,
    /// Why it is not complete.
    pub problems: Vec<String>,
    /// What an interrupted publish left (object names relative to the location; open uploads
    /// as `NAME (open upload ID)`).
    pub debris: Vec<String>,
    /// Other objects, not ours to judge or remove.
    pub other: Vec<String>,
    /// What [`clean`] removed.
    pub cleaned: Vec<String>,
}

/// One piece of debris and how to remove it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Debris {
    /// A commit marker (`.metadata`, the HF index) with no manifest: removed first.
    Marker(String),
    Object(String),
    /// A local staging file of an unfinished upload, by its path relative to the location.
    Staging(String),
    Upload {
        key: String,
        upload_id: String,
    },
    /// The pending record: removed last, so an interrupted clean still knows what was ours.
    Record,
}

impl Debris {
    fn describe(&self) -> String {
        match self {
            Debris::Marker(n) | Debris::Object(n) | Debris::Staging(n) => n.clone(),
            Debris::Upload { key, upload_id } => format!("{key} (open upload {upload_id})"),
            Debris::Record => PENDING.to_string(),
        }
    }
}

/// Lists objects under the location: relative name → size.
async fn list(dest: &Destination) -> Result<BTreeMap<String, u64>, PublishError> {
    let prefix = format!("{}/", dest.prefix.as_ref());
    let listed: Vec<object_store::ObjectMeta> = match dest.store.list(Some(&dest.prefix)).try_collect().await {
        Ok(v) => v,
        // A local location that does not exist lists as an error on some versions.
        Err(object_store::Error::NotFound { .. }) => Vec::new(),
        Err(e) => return Err(store_err(dest, "", "list", e)),
    };
    Ok(listed
        .into_iter()
        .map(|m| {
            let key = m.location.as_ref();
            (key.strip_prefix(&prefix).unwrap_or(key).to_string(), m.size)
        })
        .collect())
}

/// The local file system's staging files of unfinished uploads (`NAME#N`), which its listing
/// hides.
fn local_staging(dest: &Destination) -> Vec<String> {
    let Backend::Local(dir) = &dest.backend else { return Vec::new() };
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.rsplit_once('#').is_some_and(|(_, k)| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit())))
        .collect();
    out.sort();
    out
}

/// Surveys the location (see the module documentation).
pub async fn survey(dest: &Destination) -> Result<LocationReport, PublishError> {
    Ok(survey_with_debris(dest).await?.0)
}

async fn survey_with_debris(dest: &Destination) -> Result<(LocationReport, BTreeSet<Debris>), PublishError> {
    let listed = list(dest).await?;
    let manifest_bytes = get_bytes(dest, MANIFEST).await?;
    let pending: Option<Pending> = get_bytes(dest, PENDING).await?.and_then(|b| serde_json::from_slice(&b).ok());
    let mut report = LocationReport {
        url: dest.display.clone(),
        state: LocationState::Incomplete,
        manifest_sha256: None,
        torch_visible: listed.contains_key(DCP_METADATA),
        files: listed.len(),
        problems: Vec::new(),
        debris: Vec::new(),
        other: Vec::new(),
        cleaned: Vec::new(),
    };
    let mut debris: BTreeSet<Debris> = BTreeSet::new();
    let mut ours: BTreeSet<String> = [MANIFEST, PENDING].iter().map(|s| s.to_string()).collect();

    let manifest: Option<Manifest> = match &manifest_bytes {
        Some(b) => match serde_json::from_slice(b) {
            Ok(m) => Some(m),
            Err(e) => {
                report.problems.push(format!("{MANIFEST} is not a manifest: {e}"));
                None
            }
        },
        None => None,
    };
    match (&manifest, &manifest_bytes) {
        (Some(m), Some(bytes)) => {
            for f in &m.files {
                ours.insert(f.path.clone());
                match listed.get(&f.path) {
                    None => report.problems.push(format!("{}: listed by the manifest but missing", f.path)),
                    Some(size) if *size != f.size => {
                        report.problems.push(format!("{}: {size} bytes, the manifest says {}", f.path, f.size))
                    }
                    Some(_) => {}
                }
            }
            if report.problems.is_empty() {
                report.state = LocationState::Complete;
                report.manifest_sha256 = Some(hex::encode(Sha256::digest(bytes)));
            }
        }
        _ if listed.is_empty() && local_staging(dest).is_empty() => report.state = LocationState::Empty,
        _ => {
            if report.torch_visible {
                report
                    .problems
                    .push(format!("no manifest, but `{DCP_METADATA}` is there: torch takes this for a checkpoint"));
            } else {
                report.problems.push("no manifest: not a complete checkpoint".to_string());
            }
        }
    }

    if let Some(p) = &pending {
        debris.insert(Debris::Record);
        if report.state != LocationState::Complete {
            // What the interrupted publish wrote, and what it still vouched for: none of it is a
            // checkpoint any more (its manifest was withdrawn).
            for name in p.touching.iter().chain(p.trusted.iter().map(|f| &f.path)) {
                ours.insert(name.clone());
                if listed.contains_key(name) {
                    let marker = name == DCP_METADATA || name == HF_INDEX;
                    debris.insert(if marker { Debris::Marker(name.clone()) } else { Debris::Object(name.clone()) });
                }
            }
        }
    }
    for name in local_staging(dest) {
        debris.insert(Debris::Staging(name));
    }
    if let Some(open) = dest.open_uploads().await? {
        for u in open {
            debris.insert(Debris::Upload { key: u.key, upload_id: u.upload_id });
        }
    }
    if report.state == LocationState::Complete {
        report.problems.clear();
    }
    report.other = listed.keys().filter(|n| !ours.contains(*n)).cloned().collect();
    report.debris = debris.iter().map(Debris::describe).collect();
    Ok((report, debris))
}

/// Removes the debris [`survey`] finds (commit markers first, the pending record last) and
/// surveys again. A complete checkpoint's files are never removed.
pub async fn clean(dest: &Destination) -> Result<LocationReport, PublishError> {
    let (_, debris) = survey_with_debris(dest).await?;
    let mut cleaned = Vec::new();
    for d in &debris {
        match d {
            Debris::Marker(n) | Debris::Object(n) => delete_if_present(dest, n, "remove debris").await?,
            Debris::Staging(n) => {
                if let Backend::Local(dir) = &dest.backend {
                    let path = dir.join(n);
                    std::fs::remove_file(&path).or_else(|e| match e.kind() {
                        std::io::ErrorKind::NotFound => Ok(()),
                        _ => Err(PublishError::Io { path, action: "remove staging file", error: e }),
                    })?;
                }
            }
            Debris::Upload { key, upload_id } => {
                if let Some(mp) = &dest.multipart {
                    match mp.abort_multipart(&dest.object(key), upload_id).await {
                        Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                        Err(e) => return Err(store_err(dest, key, "abort upload", e)),
                    }
                }
            }
            Debris::Record => delete_if_present(dest, PENDING, "remove the pending record").await?,
        }
        cleaned.push(d.describe());
    }
    let mut after = survey(dest).await?;
    after.cleaned = cleaned;
    Ok(after)
}
