//! Against moto's S3 server: uploads stay invisible until completed, aborted ones leave nothing,
//! ranged reads land at their offsets and refuse a replaced object.

use std::fs::{self, File};
use std::sync::Arc;

use shardline_publish::moto::Moto;

use super::*;

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 11) as u8).collect()
}

fn setup(dir: &std::path::Path) -> (Moto, Artifacts) {
    let moto = Moto::start(dir);
    moto.create_bucket("art");
    let a = Artifacts::open("s3://art/runs/r1", &moto.store_options()).unwrap();
    (moto, a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_is_listed_only_once_completed_and_holds_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let (moto, a) = setup(tmp.path());
    let bytes = data((PART_BYTES + (3 << 20) + 17) as usize, 1);
    let path = tmp.path().join("rank0");
    fs::write(&path, &bytes).unwrap();
    let mut registered = None;
    let upload = a
        .upload_file("ckpt/__0_0.distcp", &path, |id| {
            registered = Some(id);
            async { true }
        })
        .await
        .unwrap();
    assert_eq!(registered.as_deref(), Some(upload.upload_id.as_str()));
    assert_eq!(upload.parts.len(), 2);
    assert_eq!(upload.size, bytes.len() as u64);
    assert!(moto.list_keys("art", "runs/").is_empty(), "an open upload must not be an object");
    assert_eq!(moto.open_multipart_uploads("art"), 1);

    a.complete(&upload).await.unwrap();
    assert_eq!(moto.list_keys("art", "runs/"), vec!["runs/r1/ckpt/__0_0.distcp".to_string()]);
    assert_eq!(moto.open_multipart_uploads("art"), 0);
    // A commit retried after completing finds the object and succeeds.
    a.complete(&upload).await.unwrap();
    let listed = a.list().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].name.as_str(), listed[0].size), ("ckpt/__0_0.distcp", bytes.len() as u64));

    // Ranges land at their own offsets of a sparse local file; the rest stays zero.
    let local = tmp.path().join("sparse");
    let file = File::create(&local).unwrap();
    file.set_len(bytes.len() as u64).unwrap();
    let ranges = [(5u64, 70u64), (PIECE_BYTES - 3, PIECE_BYTES * 2 + 9), (bytes.len() as u64 - 4, bytes.len() as u64)];
    let n = a.fetch_ranges("ckpt/__0_0.distcp", listed[0].e_tag.as_deref(), &ranges, Arc::new(file)).await.unwrap();
    assert_eq!(n, ranges.iter().map(|(s, e)| e - s).sum::<u64>());
    let got = fs::read(&local).unwrap();
    for (i, (g, b)) in got.iter().zip(&bytes).enumerate() {
        let inside = ranges.iter().any(|&(s, e)| (s..e).contains(&(i as u64)));
        assert_eq!(*g, if inside { *b } else { 0 }, "byte {i}");
    }

    // A replaced object fails a read pinned to the listed version.
    a.put_small("ckpt/__0_0.distcp", data(100, 9)).await.unwrap();
    let file = Arc::new(File::create(tmp.path().join("again")).unwrap());
    let err = a.fetch_ranges("ckpt/__0_0.distcp", listed[0].e_tag.as_deref(), &[(0, 10)], file).await.unwrap_err();
    assert!(matches!(err, ArtifactError::Store { action: "read", .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_registration_or_an_abort_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let (moto, a) = setup(tmp.path());
    let path = tmp.path().join("f");
    fs::write(&path, data(1000, 2)).unwrap();
    let err = a.upload_file("x", &path, |_| async { false }).await.unwrap_err();
    assert!(matches!(err, ArtifactError::Fenced(_)), "{err}");
    assert_eq!(moto.open_multipart_uploads("art"), 0);

    let upload = a.upload_file("y", &path, |_| async { true }).await.unwrap();
    assert_eq!(moto.open_multipart_uploads("art"), 1);
    a.abort("y", &upload.upload_id).await.unwrap();
    a.abort("y", &upload.upload_id).await.unwrap();
    assert_eq!(moto.open_multipart_uploads("art"), 0);
    assert!(moto.list_keys("art", "").is_empty());
    assert!(a.complete(&upload).await.is_err(), "an aborted upload cannot be completed");
}

#[test]
fn a_local_directory_is_not_an_artifact_store() {
    let err = Artifacts::open("file:///tmp/x", &[]).unwrap_err();
    assert!(err.to_string().contains("shared file system"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_filled_a_range_at_a_time_holds_the_file_and_refuses_short_parts_but_the_last() {
    let tmp = tempfile::tempdir().unwrap();
    let (moto, a) = setup(tmp.path());
    let bytes = data((2 * PART_BYTES + 5) as usize, 3);
    let path = tmp.path().join("rank1");
    fs::write(&path, &bytes).unwrap();
    let file = Arc::new(File::open(&path).unwrap());
    let mut up = a.begin_upload("ckpt/__1_0.distcp", |_| async { true }).await.unwrap();
    // Nothing yet, then one part, then a range that would end in a short part.
    a.put_parts(&mut up, &file, &path, 0, false).await.unwrap();
    a.put_parts(&mut up, &file, &path, PART_BYTES, false).await.unwrap();
    assert_eq!(up.size(), PART_BYTES);
    assert!(a.put_parts(&mut up, &file, &path, PART_BYTES + 7, false).await.is_err());
    a.put_parts(&mut up, &file, &path, bytes.len() as u64, true).await.unwrap();
    let upload = up.open();
    assert_eq!((upload.parts.len(), upload.size), (3, bytes.len() as u64));
    a.complete(&upload).await.unwrap();
    assert_eq!(a.read_range("ckpt/__1_0.distcp", None, 0, bytes.len() as u64).await.unwrap(), bytes);
    assert_eq!(moto.open_multipart_uploads("art"), 0);

    // An empty file is one empty part.
    let empty = tmp.path().join("empty");
    fs::write(&empty, b"").unwrap();
    let upload = a.upload_file("ckpt/__2_0.distcp", &empty, |_| async { true }).await.unwrap();
    assert_eq!((upload.parts.len(), upload.size), (1, 0));
    a.complete(&upload).await.unwrap();
    assert_eq!(a.head("ckpt/__2_0.distcp").await.unwrap(), Some(0));
}

/// An upload whose creator never recorded its id is found by listing the store's open uploads
/// under the prefix (and only under it), then aborted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_uploads_are_listed_by_the_store_under_the_prefix_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let (moto, a) = setup(tmp.path());
    assert_eq!(a.open_uploads().await.unwrap(), Some(Vec::new()));
    let path = tmp.path().join("rank");
    fs::write(&path, data(1 << 20, 3)).unwrap();
    let mut ids = Vec::new();
    for name in ["ckpt/__0_0.distcp", "ckpt/__1_0.distcp"] {
        let mut upload = a.begin_upload(name, |_| async { true }).await.unwrap();
        let file = Arc::new(File::open(&path).unwrap());
        a.put_parts(&mut upload, &file, &path, 1 << 20, true).await.unwrap();
        ids.push((name.to_string(), upload.open().upload_id));
    }
    // Another prefix's upload is not this prefix's.
    let other = Artifacts::open("s3://art/runs/r10", &moto.store_options()).unwrap();
    other.begin_upload("x", |_| async { true }).await.unwrap();
    assert_eq!(moto.open_multipart_uploads("art"), 3);

    let mut open = a.open_uploads().await.unwrap().expect("S3 lists its open uploads");
    open.sort_by(|x, y| x.key.cmp(&y.key));
    let listed: Vec<(String, String)> = open.iter().map(|u| (u.key.clone(), u.upload_id.clone())).collect();
    assert_eq!(listed, ids);
    // moto answers a fixed creation time of its own; the field is read, whatever it says.
    assert!(open.iter().all(|u| u.initiated.is_some()), "{open:?}");
    for u in &open {
        a.abort(&u.key, &u.upload_id).await.unwrap();
    }
    assert_eq!(a.open_uploads().await.unwrap(), Some(Vec::new()));
    assert_eq!(moto.open_multipart_uploads("art"), 1, "the other prefix's upload stays");
}
