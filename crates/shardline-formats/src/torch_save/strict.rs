//! What an archive must be beyond a readable central directory: the checks torch's
//! `PytorchStreamReader` and miniz make when they open an archive and locate a record, plus the
//! ones that make a torch archive what torch writes (so a corruption torch happens to tolerate
//! today does not pass either).
//!
//! * Every entry is stored, on disk 0, named `<dir>/<record>` for one directory and a record torch
//!   writes (`data.pkl`, `byteorder`, `version`, `.data/version`, `.format_version`,
//!   `.storage_alignment`, `.data/serialization_id`, `data/<key>`), each name once.
//! * Each local header agrees with its central record (signature, version, flags, method, name,
//!   and crc and sizes unless a data descriptor carries them, which must then agree too); entries
//!   lie in order without overlapping and end before the central directory; storage records
//!   start 64-byte aligned.
//! * `data.pkl` and a `version` record exist; `version` is a decimal file format version torch
//!   reads (1 to 10); `byteorder` is `little`; `.format_version` and `.storage_alignment` are
//!   decimal.

use super::read::{le16, le32, le64, Archive, ArchiveEntry, ReadAt};
use super::{TorchSaveError, DATA_ALIGNMENT, EXTRA_PADDING, EXTRA_ZIP64, LOCAL_HEADER_LEN, SIG_LOCAL};

/// General purpose flags torch's writers set: sizes in a data descriptor (bit 3), UTF-8 names
/// (bit 11).
const KNOWN_FLAGS: u16 = 0x0008 | 0x0800;
const FLAG_DESCRIPTOR: u16 = 0x0008;
const SIG_DESCRIPTOR: u32 = 0x0807_4b50;
/// The file format versions torch's reader accepts (`kMinSupportedFileFormatVersion`,
/// `kMaxSupportedFileFormatVersion`).
const FILE_FORMAT_VERSIONS: std::ops::RangeInclusive<u64> = 1..=10;

fn corrupt(msg: String) -> TorchSaveError {
    TorchSaveError::Corrupt(msg)
}

/// Whether `rel` (a name inside the archive directory) is a record torch writes.
fn known_record(rel: &str) -> bool {
    matches!(
        rel,
        "data.pkl"
            | "byteorder"
            | "version"
            | ".data/version"
            | ".format_version"
            | ".storage_alignment"
            | ".data/serialization_id"
    ) || rel.strip_prefix("data/").is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
}

/// Checks `ar` (already parsed down to its central directory) as described in the module docs.
pub(super) fn check_archive<R: ReadAt + ?Sized>(ar: &Archive<'_, R>) -> Result<(), TorchSaveError> {
    // An archive has a handful of entries: a list is cheaper than a set.
    let mut names: Vec<&str> = Vec::with_capacity(ar.entries.len());
    for e in &ar.entries {
        let rel = e
            .name
            .strip_prefix(ar.dir.as_str())
            .ok_or_else(|| corrupt(format!("entry {} is not in the archive directory {}", e.name, ar.dir)))?;
        if !known_record(rel) {
            return Err(corrupt(format!("entry {} is not a record torch writes", e.name)));
        }
        if names.contains(&rel) {
            return Err(corrupt(format!("entry {} appears twice", e.name)));
        }
        names.push(rel);
        if e.method != 0 {
            return Err(TorchSaveError::Compressed { name: e.name.clone(), method: e.method });
        }
        if e.flags & !KNOWN_FLAGS != 0 || e.version_needed > 45 || e.compressed_size != e.size {
            return Err(corrupt(format!(
                "entry {}: flags {:#06x}, version {}, sizes {}/{} are not those of a stored entry",
                e.name, e.flags, e.version_needed, e.compressed_size, e.size
            )));
        }
    }
    let mut by_offset: Vec<&ArchiveEntry> = ar.entries.iter().collect();
    by_offset.sort_by_key(|e| e.local_header_offset);
    let mut end_of_previous = 0u64;
    for e in by_offset {
        if e.local_header_offset < end_of_previous {
            return Err(corrupt(format!("entry {} overlaps the entry before it", e.name)));
        }
        end_of_previous = check_local(ar, e)?;
    }
    if end_of_previous > ar.cd_offset {
        return Err(corrupt("entries run into the central directory".into()));
    }
    check_records(ar)
}

/// Checks `e`'s local header (and data descriptor) against its central record; returns where
/// the entry ends.
fn check_local<R: ReadAt + ?Sized>(ar: &Archive<'_, R>, e: &ArchiveEntry) -> Result<u64, TorchSaveError> {
    let at = e.local_header_offset;
    let lh = ar.read("local header", at, LOCAL_HEADER_LEN)?;
    let bad = |what: &str| corrupt(format!("entry {}: local header at offset {at}: {what}", e.name));
    if le32(&lh, 0) != SIG_LOCAL {
        return Err(bad("no local header signature"));
    }
    if le16(&lh, 4) != e.version_needed || le16(&lh, 6) != e.flags || le16(&lh, 8) != e.method {
        return Err(bad("version, flags or method differ from the central directory"));
    }
    let (name_len, extra_len) = (u64::from(le16(&lh, 26)), u64::from(le16(&lh, 28)));
    let tail = ar.read("local header name", at + LOCAL_HEADER_LEN, name_len + extra_len)?;
    let (name, extra) = tail.split_at(name_len as usize);
    if name != e.name.as_bytes() {
        return Err(bad("name differs from the central directory"));
    }
    let mut local_sizes = [u64::from(le32(&lh, 22)), u64::from(le32(&lh, 18))];
    let mut i = 0usize;
    while i < extra.len() {
        let (Some(id), Some(n)) =
            (extra.get(i..i + 2).map(|b| le16(b, 0)), extra.get(i + 2..i + 4).map(|b| le16(b, 0)))
        else {
            return Err(bad("extra data ends inside a field header"));
        };
        let body = extra.get(i + 4..i + 4 + usize::from(n)).ok_or_else(|| bad("extra field runs past the header"))?;
        match id {
            EXTRA_ZIP64 => {
                let mut f = 0;
                for s in local_sizes.iter_mut().filter(|s| **s == u64::from(u32::MAX)) {
                    *s = body.get(f..f + 8).map(|b| le64(b, 0)).ok_or_else(|| bad("zip64 field too short"))?;
                    f += 8;
                }
            }
            EXTRA_PADDING => {}
            _ => return Err(bad(&format!("unknown extra field {id:#06x}"))),
        }
        i += 4 + usize::from(n);
    }
    let data_start = at + LOCAL_HEADER_LEN + name_len + extra_len;
    let data_end = data_start.checked_add(e.size).ok_or_else(|| bad("size overflows"))?;
    let descriptor = e.flags & FLAG_DESCRIPTOR != 0;
    let local_crc = le32(&lh, 14);
    if descriptor {
        // torch's streaming writer leaves the header's crc and sizes 0 and writes them after.
        if (local_crc, local_sizes) != (0, [0, 0]) && (local_crc, local_sizes) != (e.crc32, [e.size, e.size]) {
            return Err(bad("crc or sizes differ from the central directory"));
        }
    } else if (local_crc, local_sizes) != (e.crc32, [e.size, e.size]) {
        return Err(bad("crc or sizes differ from the central directory"));
    }
    if e.name.contains("/data/") && !e.name.contains("/.data/") && !data_start.is_multiple_of(DATA_ALIGNMENT) {
        return Err(bad(&format!("storage data at offset {data_start} is not {DATA_ALIGNMENT}-byte aligned")));
    }
    if !descriptor {
        return Ok(data_end);
    }
    let zip64 = e.size >= u64::from(u32::MAX);
    let width = if zip64 { 8 } else { 4 };
    let head = ar.read("data descriptor", data_end, 4)?;
    let start = if le32(&head, 0) == SIG_DESCRIPTOR { data_end + 4 } else { data_end };
    let d = ar.read("data descriptor", start, 4 + 2 * width)?;
    let size_at = |k: usize| if zip64 { le64(&d, 4 + 8 * k) } else { u64::from(le32(&d, 4 + 4 * k)) };
    if le32(&d, 0) != e.crc32 || size_at(0) != e.size || size_at(1) != e.size {
        return Err(corrupt(format!("entry {}: data descriptor differs from the central directory", e.name)));
    }
    Ok(start + 4 + 2 * width)
}

/// The records torch reads before the tensor: `version` (required, a supported version),
/// `byteorder`, `.format_version`, `.storage_alignment`.
fn check_records<R: ReadAt + ?Sized>(ar: &Archive<'_, R>) -> Result<(), TorchSaveError> {
    ar.require("data.pkl")?;
    let version = ar.entry(".data/version").or_else(|| ar.entry("version"));
    let version = version.ok_or_else(|| TorchSaveError::MissingEntry(format!("{}version", ar.dir)))?;
    let body = ar.read_small(version, 32)?;
    let text = std::str::from_utf8(&body).unwrap_or("");
    let text = text.strip_suffix('\n').unwrap_or(text);
    let parsed =
        (!text.is_empty() && text.bytes().all(|b| b.is_ascii_digit())).then(|| text.parse::<u64>().ok()).flatten();
    if !parsed.is_some_and(|v| FILE_FORMAT_VERSIONS.contains(&v)) {
        return Err(corrupt(format!("record {}: {body:?} is not a supported file format version", version.name)));
    }
    if let Some(e) = ar.entry("byteorder") {
        let body = ar.read_small(e, 16)?;
        if *body != *b"little" {
            return Err(TorchSaveError::ByteOrder(String::from_utf8_lossy(&body).into_owned()));
        }
    }
    for rel in [".format_version", ".storage_alignment"] {
        if let Some(e) = ar.entry(rel) {
            let body = ar.read_small(e, 32)?;
            if body.is_empty() || !body.iter().all(u8::is_ascii_digit) {
                return Err(corrupt(format!("record {}: {body:?} is not a decimal number", e.name)));
            }
        }
    }
    Ok(())
}
