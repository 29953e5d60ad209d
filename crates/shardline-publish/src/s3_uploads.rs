//! The multipart uploads still open under a prefix of an S3 bucket (`ListMultipartUploads`),
//! which object_store does not list: an upload whose creator died before it recorded the upload's
//! id anywhere can only be found, and aborted, this way. The request is signed by object_store's
//! own SigV4 authorizer with the store's credentials, sent with reqwest, and its XML read with
//! quick-xml.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey, AwsAuthorizer};
use object_store::client::{HttpRequest, HttpRequestBody};
use serde::Deserialize;

use crate::PublishError;

/// An open multipart upload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenMultipart {
    /// The object's key in the bucket.
    pub key: String,
    pub upload_id: String,
    /// When it was created (`None`: the store did not say in a form read here).
    pub initiated: Option<DateTime<Utc>>,
}

/// What lists a bucket's open uploads: the store (for its credentials), the bucket's URL, the
/// signing region.
#[derive(Clone, Debug)]
pub(crate) struct S3Uploads {
    s3: Arc<AmazonS3>,
    bucket_url: String,
    region: String,
    client: reqwest::Client,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ListResult {
    #[serde(default)]
    upload: Vec<Upload>,
    #[serde(default)]
    is_truncated: bool,
    next_key_marker: Option<String>,
    next_upload_id_marker: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Upload {
    key: String,
    upload_id: String,
    initiated: Option<String>,
}

impl S3Uploads {
    /// From the builder `s3` was built with: its endpoint (path-style unless virtual-hosted
    /// requests are configured, as object_store addresses it), else AWS's for the region.
    pub(crate) fn new(builder: &AmazonS3Builder, bucket: &str, s3: Arc<AmazonS3>) -> S3Uploads {
        let get = |k| builder.get_config_value(&k);
        let region = get(AmazonS3ConfigKey::Region).unwrap_or_else(|| "us-east-1".into());
        let virtual_hosted = get(AmazonS3ConfigKey::VirtualHostedStyleRequest).is_some_and(|v| v == "true");
        let bucket_url = match get(AmazonS3ConfigKey::Endpoint) {
            Some(e) if virtual_hosted => e.trim_end_matches('/').to_string(),
            Some(e) => format!("{}/{bucket}", e.trim_end_matches('/')),
            None => format!("https://{bucket}.s3.{region}.amazonaws.com"),
        };
        S3Uploads { s3, bucket_url, region, client: reqwest::Client::new() }
    }

    /// Every open upload whose key starts with `prefix`, page by page.
    pub(crate) async fn list(&self, prefix: &str) -> Result<Vec<OpenMultipart>, PublishError> {
        let mut out = Vec::new();
        let mut markers: Option<(String, String)> = None;
        loop {
            let mut url = url::Url::parse(&self.bucket_url).map_err(|e| config(e.to_string()))?;
            url.query_pairs_mut().append_pair("uploads", "").append_pair("prefix", prefix);
            if let Some((key, id)) = &markers {
                url.query_pairs_mut().append_pair("key-marker", key).append_pair("upload-id-marker", id);
            }
            let page = self.page(url).await?;
            out.extend(page.upload.into_iter().map(|u| OpenMultipart {
                key: u.key,
                upload_id: u.upload_id,
                initiated:
                    u.initiated.and_then(|t| DateTime::parse_from_rfc3339(&t).ok()).map(|t| t.with_timezone(&Utc)),
            }));
            match (page.is_truncated, page.next_key_marker, page.next_upload_id_marker) {
                (true, Some(key), Some(id)) => markers = Some((key, id)),
                _ => return Ok(out),
            }
        }
    }

    async fn page(&self, url: url::Url) -> Result<ListResult, PublishError> {
        let credential = self.s3.credentials().get_credential().await.map_err(|e| config(e.to_string()))?;
        let mut request: HttpRequest = http::Request::builder()
            .method(http::Method::GET)
            .uri(url.as_str())
            .body(HttpRequestBody::empty())
            .map_err(|e| config(e.to_string()))?;
        AwsAuthorizer::new(&credential, "s3", &self.region)
            .try_authorize(&mut request, None)
            .map_err(|e| config(e.to_string()))?;
        let response = self
            .client
            .get(url.as_str())
            .headers(request.headers().clone())
            .send()
            .await
            .map_err(|e| config(format!("listing open uploads: {e}")))?;
        let status = response.status();
        let body = response.text().await.map_err(|e| config(format!("listing open uploads: {e}")))?;
        if !status.is_success() {
            let head: String = body.chars().take(300).collect();
            return Err(config(format!("listing open uploads: HTTP {status}: {head}")));
        }
        quick_xml::de::from_str(&body).map_err(|e| config(format!("listing open uploads: unreadable answer: {e}")))
    }
}

fn config(message: String) -> PublishError {
    PublishError::Config(message)
}
