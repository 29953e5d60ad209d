//! The token never appears in an error (`Display` or `Debug`), a `Debug` of the client or its
//! configuration, or anything logged through `tracing` or `log` at any level.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::*;
use shardline_hub::fake::{Fault, FaultKind, FaultTarget};
use shardline_hub::{HubClient, HubEnv, Secret};

const TOKEN: &str = "hf_SeCrEtToKeN0123456789abcdef";

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_never_appears_in_errors_or_logs() {
    let capture = Capture::default();
    let w = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || w.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).unwrap();
    let _ = tracing_log::LogTracer::init();

    let (hub, _) = hub_with_release().await;
    hub.require_token(REPO, TOKEN);
    let cache = tempfile::tempdir().unwrap();
    let good = client_with_token(&hub, TOKEN);
    let wrong = client_with_token(&hub, &format!("{TOKEN}x"));
    let mut errors = Vec::new();

    // Success, with every log level on.
    good.download(REPO, "main", &opts(cache.path())).await.unwrap();
    // Failures of every kind, with the token sent.
    errors.push(wrong.download(REPO, "main", &opts(cache.path())).await.unwrap_err());
    errors.push(wrong.head_sha(REPO, "main", None).await.unwrap_err());
    hub.inject(Fault::new(FaultTarget::Api, FaultKind::ServerError).times(4));
    errors.push(good.resolve(REPO, "main").await.unwrap_err());
    hub.clear_faults();
    hub.inject(Fault::new(FaultTarget::File("config.json".into()), FaultKind::Corrupt));
    errors.push(good.download(REPO, "main", &opts(tempfile::tempdir().unwrap().path())).await.unwrap_err());
    hub.clear_faults();
    hub.inject(Fault::new(FaultTarget::File("config.json".into()), FaultKind::CutAfter(0)));
    errors.push(good.download(REPO, "main", &opts(tempfile::tempdir().unwrap().path())).await.unwrap_err());
    errors.push(good.download("acme/missing", "main", &opts(cache.path())).await.unwrap_err());
    let closed =
        HubClient::new("http://127.0.0.1:9", Some(Secret::new(TOKEN))).unwrap().with_retry_policy(fast_retry());
    errors.push(closed.resolve(REPO, "main").await.unwrap_err());

    for e in &errors {
        for text in [e.to_string(), format!("{e:?}")] {
            assert!(!text.contains(TOKEN), "token in an error: {text}");
        }
    }
    for text in [
        format!("{good:?}"),
        format!("{:?}", Secret::new(TOKEN)),
        format!(
            "{:?}",
            HubEnv::from_lookup(|k| (k == "HF_TOKEN")
                .then(|| TOKEN.to_owned())
                .or_else(|| (k == "HOME").then(|| "/h".into())))
            .unwrap()
        ),
        format!("{:?}", hub.requests()),
    ] {
        assert!(!text.contains(TOKEN), "token in a Debug: {text}");
    }

    let logs = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    assert!(logs.contains("retrying") && logs.contains("snapshot ready"), "the capture works:\n{logs}");
    assert!(!logs.contains(TOKEN), "token in the logs");
    assert!(!logs.contains(&TOKEN[3..]), "token in the logs");
}
