//! The publish protocol against the local filesystem and a real S3-compatible server (moto),
//! case by case the same way: every case runs once per backend.

mod support;

use std::fs;
use std::sync::Arc;

use serde_json::json;
use shardline_publish::object_store::{Attribute, GetOptions, ObjectStore, ObjectStoreExt, PutPayload};
use shardline_publish::{
    clean, publish, publish_to, read_manifest_at, survey, AfterUpload, LocationState, PublishError, PublishOptions,
    MANIFEST, PENDING, SHA256_METADATA,
};
use support::{Faults, Fixture, BIG, FILES};

macro_rules! on_both_backends {
    ($($case:ident),* $(,)?) => {$(
        mod $case {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn local() {
                super::$case(super::Fixture::local()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn s3() {
                super::$case(super::Fixture::s3()).await
            }
        }
    )*};
}

on_both_backends!(
    publishes_data_then_the_manifest,
    killed_mid_upload_then_retried,
    republishing_identical_content_uploads_nothing,
    changing_one_file_uploads_only_it,
    a_failure_mid_upload_leaves_no_manifest_and_a_retry_completes,
    verification_catches_a_corrupted_object,
    a_failure_before_the_manifest_leaves_data_but_no_manifest,
    dcp_safetensors_files_become_visible_together,
    a_survey_names_the_checkpoint_or_the_debris_and_clean_removes_it,
);

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn source() -> serde_json::Value {
    json!({"repo": "org/model", "sha": "0123456789abcdef0123456789abcdef01234567"})
}

fn layout() -> serde_json::Value {
    json!({"mesh": "tp2·cp1·dp1·ep1·etp1", "format": "dcp"})
}

async fn assert_published(f: &Fixture, manifest: &shardline_publish::Manifest) {
    assert_eq!(read_manifest_at(&f.dest).await.unwrap().as_ref(), Some(manifest));
    let listed: Vec<&str> = manifest.files.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(listed, FILES);
    for name in FILES {
        let want = fs::read(f.src.join(name)).unwrap();
        let got = f.object(name).await.unwrap_or_else(|| panic!("{name} is not published"));
        assert!(got == want, "{name}: the published bytes differ from the source");
    }
    assert!(f.object(PENDING).await.is_none(), "the record of the publish in progress is left behind");
}

/// A fresh destination gets every file (the big one in parts), each verified by reading it
/// back, and the manifest strictly after all data.
async fn publishes_data_then_the_manifest(f: Fixture) {
    let (rec, dest) = f.faulty(Faults::default());
    let before = f.requests_so_far();
    let (m, r) = publish_to(&dest, &f.src, source(), layout(), &f.options).await.unwrap();
    assert_eq!(r.copied, strings(&FILES));
    assert!(r.skipped.is_empty() && r.resumed.is_empty());
    let total: u64 = m.files.iter().map(|e| e.size).sum();
    assert_eq!(r.bytes_copied, total);
    assert_eq!(r.bytes_verified, total, "every object is read back");
    assert_eq!(r.parts_uploaded, 3, "11 MiB in 5 MiB parts");
    assert!(r.manifest_written);
    assert_eq!(m.source, source());
    assert_eq!(m.layout, layout());
    assert_eq!(m.shardline_version, env!("CARGO_PKG_VERSION"));

    // Order as the store saw it: the record of the publish, the withdrawal of any old commit
    // (manifest, then `.metadata`), the data (in any order), `.metadata`, the manifest, the
    // record's removal.
    let writes = rec.writes();
    assert_eq!(writes[..3], strings(&[&format!("put {PENDING}"), &format!("delete {MANIFEST}"), "delete .metadata"]));
    assert_eq!(
        writes[writes.len() - 3..],
        strings(&["put .metadata", &format!("put {MANIFEST}"), &format!("delete {PENDING}")])
    );
    let mut data: Vec<String> = writes[3..writes.len() - 3].to_vec();
    data.sort();
    let mut want: Vec<String> =
        FILES[..4].iter().map(|n| format!("{} {n}", if *n == BIG { "complete" } else { "put" })).collect();
    want.sort();
    assert_eq!(data, want);

    if let Some(moto) = &f.moto {
        // The server's own log agrees: the manifest PUT follows every data PUT and the
        // CompleteMultipartUpload POST; the big file went up in three parts.
        let writes = moto.writes_since(before);
        let key = |n: &str| format!("/{}/{}/{n}", support::BUCKET, support::PREFIX);
        let manifest_at = writes.iter().position(|w| *w == format!("PUT {}", key(MANIFEST))).expect("manifest PUT");
        for name in FILES {
            let last = writes.iter().rposition(|w| w.ends_with(&key(name))).expect("data write");
            assert!(last < manifest_at, "{name} written after the manifest: {writes:#?}");
        }
        assert_eq!(writes.iter().filter(|w| *w == &format!("PUT {}", key(BIG))).count(), 3, "{writes:#?}");
        let metadata_at = writes.iter().position(|w| *w == format!("PUT {}", key(".metadata"))).expect(".metadata PUT");
        for name in &FILES[..4] {
            let last = writes.iter().rposition(|w| w.ends_with(&key(name))).expect("data write");
            assert!(last < metadata_at, "{name} written after .metadata: {writes:#?}");
        }
        let delete = format!("POST /{}?delete", support::BUCKET);
        assert_eq!(writes[..3], [format!("PUT {}", key(PENDING)), delete.clone(), delete.clone()], "{writes:#?}");
        assert_eq!(writes[writes.len() - 2..], [format!("PUT {}", key(MANIFEST)), delete], "{writes:#?}");
        // The big object was read back in part-sized ranges, each one GET.
        let gets = moto.requests()[before..].iter().filter(|(m, p, _)| m == "GET" && *p == key(BIG)).count();
        assert_eq!(gets, 3, "ranged read-back of {BIG}");
        // Each object carries its SHA-256 as user metadata.
        for e in &m.files {
            let head =
                f.dest.store().get_opts(&f.dest.object(&e.path), GetOptions::new().with_head(true)).await.unwrap();
            let recorded = head.attributes.get(&Attribute::Metadata(SHA256_METADATA.into())).map(|v| v.to_string());
            assert_eq!(recorded.as_deref(), Some(e.sha256.as_str()), "{}", e.path);
        }
    }
    assert_published(&f, &m).await;
}

/// The same content again writes nothing at all; new source/layout metadata only replaces the
/// manifest.
async fn republishing_identical_content_uploads_nothing(f: Fixture) {
    publish(&f.src, &f.to, source(), layout(), &f.options).await.unwrap();
    let (rec, dest) = f.faulty(Faults::default());
    let before = f.requests_so_far();
    let (m, r) = publish_to(&dest, &f.src, source(), layout(), &f.options).await.unwrap();
    assert!(r.copied.is_empty() && r.resumed.is_empty(), "{r:?}");
    assert_eq!(r.skipped, strings(&FILES));
    assert_eq!((r.bytes_copied, r.parts_uploaded, r.manifest_written), (0, 0, false));
    assert!(rec.writes().is_empty(), "{:?}", rec.writes());
    if let Some(moto) = &f.moto {
        assert!(moto.writes_since(before).is_empty(), "{:?}", moto.writes_since(before));
    }
    assert_published(&f, &m).await;

    let new_layout = json!({"mesh": "tp2·cp1·dp1·ep1·etp1", "format": "dcp", "note": "re-run"});
    let (m2, r2) = publish_to(&dest, &f.src, source(), new_layout.clone(), &f.options).await.unwrap();
    assert!(r2.copied.is_empty() && r2.manifest_written);
    assert_eq!(rec.writes(), strings(&[&format!("put {MANIFEST}"), &format!("delete {PENDING}")]));
    assert_eq!(m2.layout, new_layout);
    assert_published(&f, &m2).await;
}

/// One changed file (same size, other bytes) is the only data upload; the old commit (manifest and
/// `.metadata`) is withdrawn before it and written again after it.
async fn changing_one_file_uploads_only_it(f: Fixture) {
    publish(&f.src, &f.to, source(), layout(), &f.options).await.unwrap();
    fs::write(f.src.join("__1_0.distcp"), b"rank one, v2!!!").unwrap();
    let (rec, dest) = f.faulty(Faults::default());
    let before = f.requests_so_far();
    let (m, r) = publish_to(&dest, &f.src, source(), layout(), &f.options).await.unwrap();
    assert_eq!(r.copied, strings(&["__1_0.distcp", ".metadata"]));
    assert_eq!(r.skipped, strings(&["__0_0.distcp", "__2_0.distcp", BIG]));
    assert_eq!(r.bytes_copied, 15 + fs::metadata(f.src.join(".metadata")).unwrap().len());
    assert_eq!(
        rec.writes(),
        strings(&[
            &format!("put {PENDING}"),
            &format!("delete {MANIFEST}"),
            "delete .metadata",
            "put __1_0.distcp",
            "put .metadata",
            &format!("put {MANIFEST}"),
            &format!("delete {PENDING}"),
        ])
    );
    if let Some(moto) = &f.moto {
        let key = |n: &str| format!("/{}/{}/{n}", support::BUCKET, support::PREFIX);
        assert_eq!(
            moto.writes_since(before),
            vec![
                format!("PUT {}", key(PENDING)),
                format!("POST /{}?delete", support::BUCKET), // the manifest (DeleteObjects)
                format!("POST /{}?delete", support::BUCKET), // .metadata
                format!("PUT {}", key("__1_0.distcp")),
                format!("PUT {}", key(".metadata")),
                format!("PUT {}", key(MANIFEST)),
                format!("POST /{}?delete", support::BUCKET), // the pending record
            ]
        );
    }
    assert_published(&f, &m).await;
}

/// A multipart upload that fails part-way is aborted and leaves no manifest; a retry uploads
/// what is missing and keeps what is there.
async fn a_failure_mid_upload_leaves_no_manifest_and_a_retry_completes(f: Fixture) {
    // A fresh destination, one file at a time: the three small files land, the big one fails
    // at its second part.
    let one_at_a_time = PublishOptions { max_files_in_flight: 1, ..f.options.clone() };
    let (rec, dest) = f.faulty(Faults { parts_before_failure: Some(1), ..Default::default() });
    let err = publish_to(&dest, &f.src, source(), layout(), &one_at_a_time).await.unwrap_err();
    assert!(matches!(err, PublishError::Store { .. }) && err.to_string().contains("injected failure"), "{err}");
    assert!(err.to_string().contains(BIG), "{err}");
    assert!(read_manifest_at(&f.dest).await.unwrap().is_none());
    assert!(rec.writes().contains(&format!("abort {BIG}")), "{:?}", rec.writes());
    assert!(f.object(BIG).await.is_none(), "an aborted upload left an object");
    assert!(f.object(".metadata").await.is_none(), ".metadata was written before the data was complete");
    if let Some(moto) = &f.moto {
        assert_eq!(moto.open_multipart_uploads(support::BUCKET), 0, "the failed multipart upload was not aborted");
    }
    let (m, r) = publish(&f.src, &f.to, source(), layout(), &f.options).await.unwrap();
    assert_eq!(r.resumed, strings(&["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]), "{r:?}");
    assert_eq!(r.copied, strings(&[BIG, ".metadata"]));
    assert_published(&f, &m).await;

    // A re-publish with two changed files fails the same way: the old manifest is gone, and
    // the retry skips what the old manifest vouched for and was not touched.
    fs::write(f.src.join("__0_0.distcp"), b"rank zero, v2!!").unwrap();
    let mut big = fs::read(f.src.join(BIG)).unwrap();
    big[6 << 20] ^= 0xff;
    fs::write(f.src.join(BIG), &big).unwrap();
    let (_, dest) = f.faulty(Faults { parts_before_failure: Some(1), ..Default::default() });
    publish_to(&dest, &f.src, source(), layout(), &f.options).await.unwrap_err();
    assert!(read_manifest_at(&f.dest).await.unwrap().is_none(), "the old manifest survived a failed re-publish");
    assert!(f.object(".metadata").await.is_none(), "the old .metadata survived a failed re-publish");
    assert!(f.object(PENDING).await.is_some());
    let (m, r) = publish(&f.src, &f.to, source(), layout(), &f.options).await.unwrap();
    assert_eq!(r.skipped, strings(&["__1_0.distcp", "__2_0.distcp"]), "{r:?}");
    assert!(r.copied.contains(&BIG.to_string()), "{r:?}");
    let mut changed = [r.copied.clone(), r.resumed.clone()].concat();
    changed.sort();
    assert_eq!(changed, strings(&[".metadata", "__0_0.distcp", BIG]));
    assert_published(&f, &m).await;
}

/// An object altered between its upload and its verification (same size, other bytes) fails
/// the publish, is removed, and no manifest appears; a retry publishes it again.
async fn verification_catches_a_corrupted_object(f: Fixture) {
    let store: Arc<dyn ObjectStore> = f.dest.store().clone();
    let target = f.dest.object("__2_0.distcp");
    let hook: AfterUpload = Arc::new(move |name: &str| {
        let store = store.clone();
        let target = target.clone();
        let tamper = name == "__2_0.distcp";
        Box::pin(async move {
            if tamper {
                let mut bytes = vec![7u8; 100_000];
                bytes[50_000] = 8;
                store.put(&target, PutPayload::from(bytes)).await.unwrap();
            }
        })
    });
    let options = PublishOptions { after_upload: Some(hook), ..f.options.clone() };
    let err = publish(&f.src, &f.to, source(), layout(), &options).await.unwrap_err();
    match &err {
        PublishError::Verify { path, expected_size, actual_size, expected, actual } => {
            assert!(path.to_string_lossy().ends_with("/__2_0.distcp"), "{err}");
            assert_eq!((*expected_size, *actual_size), (100_000, 100_000));
            assert_ne!(expected, actual);
        }
        e => panic!("expected a verification error, got {e}"),
    }
    assert!(read_manifest_at(&f.dest).await.unwrap().is_none());
    assert!(f.object("__2_0.distcp").await.is_none(), "the corrupted object was kept");
    let (m, r) = publish(&f.src, &f.to, source(), layout(), &f.options).await.unwrap();
    assert!(r.copied.contains(&"__2_0.distcp".to_string()), "{r:?}");
    assert_published(&f, &m).await;
}

/// The manifest is the last write: failing it withdraws `.metadata` (so torch and Shardline agree
/// there is no checkpoint) and leaves every data object in place, verified; a retry then uploads
/// only `.metadata` and commits.
async fn a_failure_before_the_manifest_leaves_data_but_no_manifest(f: Fixture) {
    let (_, dest) = f.faulty(Faults { fail_put_of: Some(MANIFEST.into()), ..Default::default() });
    let err = publish_to(&dest, &f.src, source(), layout(), &f.options).await.unwrap_err();
    assert!(err.to_string().contains(MANIFEST), "{err}");
    assert!(read_manifest_at(&f.dest).await.unwrap().is_none());
    assert!(f.object(".metadata").await.is_none(), "a failed publish left .metadata");
    for name in &FILES[..4] {
        assert_eq!(f.object(name).await.unwrap(), fs::read(f.src.join(name)).unwrap(), "{name}");
    }
    let (m, r) = publish(&f.src, &f.to, source(), layout(), &f.options).await.unwrap();
    assert_eq!(r.copied, strings(&[".metadata"]), "{r:?}");
    assert_eq!(r.resumed, strings(&FILES[..4]));
    assert!(r.manifest_written);
    assert_published(&f, &m).await;
}

/// DCP-safetensors has no marker (torch's reader takes every `*.safetensors` it lists), so no
/// file may become an object before every file's bytes are up: a failure at the big file's
/// second part leaves no `.safetensors` object at all (the small file before it included), and
/// an overwrite withdraws every old file first.
async fn dcp_safetensors_files_become_visible_together(f: Fixture) {
    let src = f.tmp.path().join("st");
    fs::create_dir_all(&src).unwrap();
    let names = ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"];
    fs::write(src.join(names[0]), b"small rank file").unwrap();
    fs::write(src.join(names[1]), fs::read(f.src.join(BIG)).unwrap()).unwrap();
    let one_at_a_time = PublishOptions { max_files_in_flight: 1, ..f.options.clone() };
    let (rec, dest) = f.faulty(Faults { parts_before_failure: Some(2), ..Default::default() });
    let err = publish_to(&dest, &src, source(), layout(), &one_at_a_time).await.unwrap_err();
    assert!(err.to_string().contains("injected failure"), "{err}");
    for name in names {
        assert!(f.object(name).await.is_none(), "{name} became visible before every file was up");
    }
    assert!(
        !rec.writes().iter().any(|w| w.starts_with("put shard") || w.starts_with("complete")),
        "{:?}",
        rec.writes()
    );

    let (rec, dest) = f.faulty(Faults::default());
    let (m, r) = publish_to(&dest, &src, source(), layout(), &f.options).await.unwrap();
    assert_eq!(r.copied, strings(&names));
    let writes = rec.writes();
    let completes: Vec<&String> = writes.iter().filter(|w| w.starts_with("complete")).collect();
    assert_eq!(completes.len(), 2, "{writes:?}");
    for name in names {
        assert_eq!(f.object(name).await.unwrap(), fs::read(src.join(name)).unwrap(), "{name}");
    }
    assert_eq!(read_manifest_at(&f.dest).await.unwrap(), Some(m));

    // An overwrite with one file changed withdraws both old files before uploading anything.
    fs::write(src.join(names[0]), b"small rank v2!!").unwrap();
    let (rec, dest) = f.faulty(Faults::default());
    publish_to(&dest, &src, source(), layout(), &f.options).await.unwrap();
    let writes = rec.writes();
    let want = [
        format!("put {PENDING}"),
        format!("delete {MANIFEST}"),
        format!("delete {}", names[0]),
        format!("delete {}", names[1]),
    ];
    assert_eq!(writes[..4], want, "{writes:?}");
}

/// `survey` (`verify-destination`): a complete checkpoint by its manifest's SHA-256; after a
/// failed re-publish, not complete, with the pending record and the files it wrote as debris;
/// `clean` removes them (nothing else) and a publish then completes.
async fn a_survey_names_the_checkpoint_or_the_debris_and_clean_removes_it(f: Fixture) {
    use sha2::{Digest, Sha256};
    let r = survey(&f.dest).await.unwrap();
    assert_eq!(r.state, LocationState::Empty, "{r:?}");
    publish(&f.src, &f.to, source(), layout(), &f.options).await.unwrap();
    let r = survey(&f.dest).await.unwrap();
    let manifest = f.object(MANIFEST).await.unwrap();
    assert_eq!(r.state, LocationState::Complete, "{r:?}");
    assert_eq!(r.manifest_sha256.as_deref(), Some(hex::encode(Sha256::digest(&manifest)).as_str()));
    assert!(r.torch_visible && r.debris.is_empty() && r.problems.is_empty(), "{r:?}");

    // Something that is not ours stays out of it, and a failed re-publish leaves debris.
    f.tamper("notes.txt", b"kept".to_vec()).await;
    fs::write(f.src.join("__0_0.distcp"), b"rank zero, v2!!").unwrap();
    let (_, dest) = f.faulty(Faults { fail_put_of: Some(".metadata".into()), ..Default::default() });
    publish_to(&dest, &f.src, source(), layout(), &f.options).await.unwrap_err();
    let r = survey(&f.dest).await.unwrap();
    assert_eq!(r.state, LocationState::Incomplete, "{r:?}");
    assert!(!r.torch_visible, "{r:?}");
    assert!(r.debris.contains(&PENDING.to_string()) && r.debris.contains(&"__0_0.distcp".to_string()), "{r:?}");
    assert_eq!(r.other, vec!["notes.txt".to_string()]);

    let r = clean(&f.dest).await.unwrap();
    assert!(r.cleaned.contains(&PENDING.to_string()), "{r:?}");
    assert_eq!(r.state, LocationState::Incomplete, "only notes.txt is left: {r:?}");
    assert!(r.debris.is_empty(), "{r:?}");
    assert!(f.object("notes.txt").await.is_some(), "clean removed what is not ours");
    for name in FILES {
        assert!(f.object(name).await.is_none(), "{name} survived the clean");
    }
    let (m, _) = publish(&f.src, &f.to, source(), layout(), &f.options).await.unwrap();
    assert_published(&f, &m).await;
    assert_eq!(survey(&f.dest).await.unwrap().state, LocationState::Complete);
}

/// A publish killed (SIGKILL) in the middle of a multipart upload leaves no manifest; a retry
/// keeps the files that had landed (verified by reading them back) and completes. The publish runs
/// in a child process of this test binary (`kill_child`), configured from the environment.
async fn killed_mid_upload_then_retried(f: Fixture) {
    use std::io::BufRead;
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["kill_child", "--exact", "--nocapture", "--test-threads", "1"])
        .env("SHARDLINE_PUBLISH_TEST_CHILD", "kill")
        .env("SHARDLINE_PUBLISH_TEST_SRC", &f.src)
        .env("SHARDLINE_PUBLISH_TEST_TO", &f.to)
        .stdout(std::process::Stdio::piped());
    if let Some(moto) = &f.moto {
        cmd.env("AWS_ENDPOINT_URL", moto.endpoint())
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing-secret");
    }
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let stalled = tokio::task::spawn_blocking(move || {
        std::io::BufReader::new(stdout).lines().map_while(Result::ok).any(|l| l.contains("STALLED"))
    });
    let stalled = tokio::time::timeout(std::time::Duration::from_secs(30), stalled).await;
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(matches!(stalled, Ok(Ok(true))), "the child never reached the middle of the upload ({status})");

    assert!(read_manifest_at(&f.dest).await.unwrap().is_none(), "a killed publish left a manifest");
    assert!(f.object(PENDING).await.is_some());
    assert!(f.object(BIG).await.is_none(), "an unfinished multipart upload became an object");
    assert!(f.object(".metadata").await.is_none(), "a killed publish left .metadata");
    let published = f.tmp.path().join("published");
    let staging = |dir: &std::path::Path| -> Vec<String> {
        fs::read_dir(dir)
            .map(|d| {
                d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.contains('#')).collect()
            })
            .unwrap_or_default()
    };
    if f.moto.is_none() {
        assert!(!staging(&published).is_empty(), "the local multipart upload left no staging file");
    }

    let (m, r) = publish(&f.src, &f.to, source(), layout(), &f.options).await.unwrap();
    assert_eq!(r.resumed, strings(&["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]), "{r:?}");
    assert_eq!(r.copied, strings(&[BIG, ".metadata"]));
    assert_published(&f, &m).await;
    assert!(staging(&published).is_empty(), "{:?}", staging(&published));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_child() {
    if std::env::var("SHARDLINE_PUBLISH_TEST_CHILD").as_deref() != Ok("kill") {
        return; // only meaningful as the child of `killed_mid_upload_then_retried`
    }
    let src = std::path::PathBuf::from(std::env::var("SHARDLINE_PUBLISH_TEST_SRC").unwrap());
    let to = std::env::var("SHARDLINE_PUBLISH_TEST_TO").unwrap();
    let real = shardline_publish::Destination::open(&to, &[]).unwrap();
    let metadata = to.starts_with("s3://");
    let store = Arc::new(support::FaultyStore::new(
        real.store().clone(),
        real.prefix(),
        Faults { stall_after_parts: Some(1), ..Default::default() },
    ));
    let dest = shardline_publish::Destination::from_store(store, real.prefix().as_ref(), metadata);
    let options = PublishOptions { part_size: support::PART, max_files_in_flight: 1, ..Default::default() };
    let r = publish_to(&dest, &src, source(), layout(), &options).await;
    panic!("the publish was to stall until killed, but returned {r:?}");
}

/// `Verify::Head` checks size (and the recorded SHA-256) without downloading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_verification_reads_nothing_back() {
    let f = Fixture::s3();
    let options = PublishOptions { verify: shardline_publish::Verify::Head, ..f.options.clone() };
    let (m, r) = publish(&f.src, &f.to, source(), layout(), &options).await.unwrap();
    assert_eq!(r.bytes_verified, 0);
    assert_published(&f, &m).await;
}

/// The S3 client is configured the way object_store reads its environment (`AWS_ENDPOINT_URL`,
/// `AWS_ACCESS_KEY_ID`, …), and no secret shows in errors. Runs in a child process of this test
/// binary so the variables are set before anything reads them.
#[test]
fn configured_from_the_environment_without_leaking_secrets() {
    const SECRET: &str = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY";
    let f = Fixture::s3();
    let moto = f.moto.as_ref().unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["environment_child", "--exact", "--nocapture", "--test-threads", "1"])
        .env("SHARDLINE_PUBLISH_TEST_CHILD", "environment")
        .env("SHARDLINE_PUBLISH_TEST_SRC", &f.src)
        .env("SHARDLINE_PUBLISH_TEST_TO", &f.to)
        .env("AWS_ENDPOINT_URL", moto.endpoint())
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
        .env("AWS_SECRET_ACCESS_KEY", SECRET)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("environment child: published"), "the child did not run:\n{stdout}");
    assert!(!stdout.contains(SECRET) && !stderr.contains(SECRET), "a secret was printed:\n{stdout}\n{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_child() {
    if std::env::var("SHARDLINE_PUBLISH_TEST_CHILD").as_deref() != Ok("environment") {
        return; // only meaningful as the child of the test above
    }
    let src = std::path::PathBuf::from(std::env::var("SHARDLINE_PUBLISH_TEST_SRC").unwrap());
    let to = std::env::var("SHARDLINE_PUBLISH_TEST_TO").unwrap();
    let secret = std::env::var("AWS_SECRET_ACCESS_KEY").unwrap();
    let options = PublishOptions { part_size: support::PART, ..Default::default() };
    assert!(!format!("{options:?}").contains(&secret));
    let (m, r) = publish(&src, &to, source(), layout(), &options).await.unwrap();
    assert_eq!(r.copied.len(), FILES.len());
    assert_eq!(shardline_publish::read_remote_manifest(&to).await.unwrap(), Some(m));
    assert_eq!(shardline_publish::read_remote_manifest(&format!("{to}/elsewhere")).await.unwrap(), None);

    // Failures name the destination, never the credentials, also when the secret travels in the
    // URL or in explicit options.
    let missing = format!("s3://AKIAIOSFODNN7EXAMPLE:{secret}@no-such-bucket/ckpt?token={secret}");
    let err = publish(&src, &missing, source(), layout(), &options).await.unwrap_err();
    for text in [err.to_string(), format!("{err:?}")] {
        assert!(!text.contains(&secret), "{text}");
        assert!(text.contains("no-such-bucket"), "{text}");
    }
    let explicit = PublishOptions {
        store_options: vec![("aws_secret_access_key".into(), "another-secret-value-123".into())],
        ..options.clone()
    };
    let err = publish(&src, "s3://no-such-bucket/ckpt", source(), layout(), &explicit).await.unwrap_err();
    assert!(!format!("{err} {err:?} {explicit:?}").contains("another-secret-value-123"), "{err}");
    println!("environment child: published {} files", r.copied.len());
}
