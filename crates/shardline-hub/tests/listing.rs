//! Conditional requests for watches: an unchanged listing or revision, sent with its ETag, is a 304.

use shardline_hub::fake::{FakeFile, FakeHub, RequestKind};
use shardline_hub::{HubClient, ModelListing, RevisionCheck};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_listing_is_a_304() {
    let hub = FakeHub::start().await.expect("fake hub");
    let client = HubClient::new(hub.endpoint(), None).expect("client");
    let a = hub.publish("acme/a", vec![FakeFile::new("config.json", "{}")]).expect("publish");

    let ModelListing::Changed { models, etag } =
        client.list_models_if_changed(Some("acme"), None, None).await.expect("listing")
    else {
        panic!("a first listing is never unchanged")
    };
    assert_eq!(models.len(), 1);
    assert_eq!(models[0].sha.as_deref(), Some(a.as_str()));
    let etag = etag.expect("the listing has an ETag");

    hub.clear_requests();
    let again = client.list_models_if_changed(Some("acme"), None, Some(&etag)).await.expect("listing");
    assert_eq!(again, ModelListing::Unchanged);
    let reqs = hub.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].kind, RequestKind::ListModels);
    assert_eq!(reqs[0].if_none_match.as_deref(), Some(etag.as_str()));
    assert_eq!(reqs[0].status, 304);

    // A new commit changes the listing, and its ETag.
    let a2 = hub.publish("acme/a", vec![FakeFile::new("config.json", "{\"v\": 2}")]).expect("publish");
    let ModelListing::Changed { models, etag: etag2 } =
        client.list_models_if_changed(Some("acme"), None, Some(&etag)).await.expect("listing")
    else {
        panic!("the listing changed")
    };
    assert_eq!(models[0].sha.as_deref(), Some(a2.as_str()));
    assert_ne!(etag2.as_deref(), Some(etag.as_str()));
    // `list_models` is the unconditional form.
    assert_eq!(client.list_models(Some("acme"), None).await.expect("listing").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_revision_is_a_304() {
    let hub = FakeHub::start().await.expect("fake hub");
    let client = HubClient::new(hub.endpoint(), None).expect("client");
    let a = hub.publish("acme/a", vec![FakeFile::new("config.json", "{}")]).expect("publish");
    let RevisionCheck::Changed { sha, etag } = client.revision_if_changed("acme/a", "main", None).await.expect("check")
    else {
        panic!("an unconditional check is never unchanged")
    };
    assert_eq!(sha, a);
    let etag = etag.expect("the revision has an ETag");
    hub.clear_requests();
    assert_eq!(
        client.revision_if_changed("acme/a", "main", Some(&etag)).await.expect("check"),
        RevisionCheck::Unchanged
    );
    assert_eq!(hub.requests()[0].status, 304);
    let b = hub.publish("acme/a", vec![FakeFile::new("config.json", "{\"v\": 2}")]).expect("publish");
    let got = client.revision_if_changed("acme/a", "main", Some(&etag)).await.expect("check");
    assert!(matches!(&got, RevisionCheck::Changed { sha, .. } if *sha == b), "{got:?}");
    // `head_sha` is the same check with the sha seen last.
    assert_eq!(client.head_sha("acme/a", "main", Some(&b)).await.expect("head"), None);
    assert_eq!(client.head_sha("acme/a", "main", Some(&a)).await.expect("head"), Some(b));
}
