//! Where a checkpoint is published: an object store and a prefix inside it.
//!
//! `file:///abs/dir` and `/abs/dir` are the local filesystem (object_store's `LocalFileSystem`);
//! `s3://bucket/prefix` (also `s3a://`), `gs://bucket/prefix` and `az://container/prefix` (also
//! `abfs[s]://`, `adl://`, `azure://`) are configured as object_store's builders read their
//! environment (`AmazonS3Builder::from_env()`: `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ALLOW_HTTP`, …;
//! `GoogleCloudStorageBuilder::from_env()`: `GOOGLE_SERVICE_ACCOUNT`, …;
//! `MicrosoftAzureBuilder::from_env()`: `AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ACCOUNT_KEY`,
//! …), then the caller's explicit options on top.
//!
//! Secrets never reach a message: a destination displays without user info or query, and every
//! store error passes through [`Redactor`], which removes URL queries and credentials and any
//! value of a secret-looking environment variable or option.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::local::LocalFileSystem;
use object_store::multipart::MultipartStore;
use object_store::path::Path as ObjPath;
use object_store::{ClientConfigKey, ObjectStore};

use crate::PublishError;

/// Request timeout when the environment and the options set none. object_store's own default
/// (30 s, from the whole request including its body) is too short for a 64 MiB part on a modest
/// link; reads are ranged by part size (see `engine::read_back`), so this bounds part-sized
/// transfers only.
pub const DEFAULT_REQUEST_TIMEOUT: &str = "10m";

/// Which kind of store a destination is; decides whether objects can carry metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The local filesystem, rooted at this absolute directory.
    Local(PathBuf),
    S3,
    Gcs,
    Azure,
    /// A store handed in by the caller.
    Custom {
        object_metadata: bool,
    },
}

/// An object store and the prefix under which a checkpoint's objects live.
#[derive(Clone)]
pub struct Destination {
    pub(crate) store: Arc<dyn ObjectStore>,
    /// The same store's multipart API (S3, GCS, Azure): uploads created by one process and
    /// completed or aborted by another, by id.
    pub(crate) multipart: Option<Arc<dyn MultipartStore>>,
    pub(crate) prefix: ObjPath,
    pub(crate) backend: Backend,
    pub(crate) display: String,
    pub(crate) redactor: Redactor,
    /// S3 only: what lists the bucket's open multipart uploads.
    pub(crate) uploads: Option<Arc<crate::s3_uploads::S3Uploads>>,
}

impl fmt::Debug for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Destination").field("url", &self.display).field("backend", &self.backend).finish()
    }
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display)
    }
}

impl Destination {
    /// Opens `to` (an absolute path or a `file://`, `s3://`, `gs://` or `az://` URL) with the
    /// environment's configuration, overridden by `options` (object_store configuration keys such
    /// as `aws_endpoint`, `aws_allow_http`, `google_service_account`, `azure_storage_account_name`).
    pub fn open(to: &str, options: &[(String, String)]) -> Result<Destination, PublishError> {
        let redactor = Redactor::new(options);
        let unsupported = || PublishError::UnsupportedDestination(redactor.redact(to));
        if to.starts_with('/') || to.starts_with("file://") {
            if !options.is_empty() {
                return Err(PublishError::Config(format!(
                    "store options ({}) given for a local destination",
                    options.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(", ")
                )));
            }
            let dir = crate::local_destination(to).map_err(|_| unsupported())?;
            return Destination::local(&dir);
        }
        let url = url::Url::parse(to).map_err(|_| unsupported())?;
        let prefix = ObjPath::from_url_path(url.path()).map_err(|_| unsupported())?;
        let mut base = url.clone();
        base.set_query(None);
        base.set_fragment(None);
        let _ = base.set_password(None);
        let _ = base.set_username("");
        let display = base.to_string();
        let store_err = |e: object_store::Error| PublishError::Config(redactor.redact(&e.to_string()));
        let mut uploads = None;
        let (store, multipart, backend): (Arc<dyn ObjectStore>, Arc<dyn MultipartStore>, Backend) = match url.scheme() {
            "s3" | "s3a" => {
                install_crypto_provider();
                let mut b = AmazonS3Builder::from_env().with_url(display.clone());
                if std::env::var_os("AWS_TIMEOUT").is_none() {
                    b = b.with_config(AmazonS3ConfigKey::Client(ClientConfigKey::Timeout), DEFAULT_REQUEST_TIMEOUT);
                }
                for (k, v) in options {
                    let key: AmazonS3ConfigKey = k.parse().map_err(|_| unknown_key(k))?;
                    b = b.with_config(key, v.clone());
                }
                let built = Arc::new(b.clone().build().map_err(store_err)?);
                let bucket = url.host_str().unwrap_or_default();
                uploads = Some(Arc::new(crate::s3_uploads::S3Uploads::new(&b, bucket, built.clone())));
                (built.clone(), built, Backend::S3)
            }
            "gs" => {
                install_crypto_provider();
                let mut b = GoogleCloudStorageBuilder::from_env().with_url(display.clone());
                if std::env::var_os("GOOGLE_TIMEOUT").is_none() {
                    b = b.with_config(GoogleConfigKey::Client(ClientConfigKey::Timeout), DEFAULT_REQUEST_TIMEOUT);
                }
                for (k, v) in options {
                    let key: GoogleConfigKey = k.parse().map_err(|_| unknown_key(k))?;
                    b = b.with_config(key, v.clone());
                }
                let built = Arc::new(b.build().map_err(store_err)?);
                (built.clone(), built, Backend::Gcs)
            }
            "az" | "adl" | "azure" | "abfs" | "abfss" => {
                install_crypto_provider();
                let mut b = MicrosoftAzureBuilder::from_env().with_url(display.clone());
                if std::env::var_os("AZURE_TIMEOUT").is_none() {
                    b = b.with_config(AzureConfigKey::Client(ClientConfigKey::Timeout), DEFAULT_REQUEST_TIMEOUT);
                }
                for (k, v) in options {
                    let key: AzureConfigKey = k.parse().map_err(|_| unknown_key(k))?;
                    b = b.with_config(key, v.clone());
                }
                let built = Arc::new(b.build().map_err(store_err)?);
                (built.clone(), built, Backend::Azure)
            }
            _ => return Err(unsupported()),
        };
        Ok(Destination { store, multipart: Some(multipart), prefix, backend, display, redactor, uploads })
    }

    /// The local directory `dir` (absolute) through object_store's `LocalFileSystem`.
    pub fn local(dir: &Path) -> Result<Destination, PublishError> {
        if !dir.is_absolute() {
            return Err(PublishError::UnsupportedDestination(dir.display().to_string()));
        }
        let prefix = ObjPath::from_absolute_path(dir)
            .map_err(|_| PublishError::UnsupportedDestination(dir.display().to_string()))?;
        Ok(Destination {
            store: Arc::new(LocalFileSystem::new()),
            multipart: None,
            prefix,
            backend: Backend::Local(dir.to_path_buf()),
            display: format!("file://{}", dir.display()),
            redactor: Redactor::new(&[]),
            uploads: None,
        })
    }

    /// A store the caller built (a differently configured client, a wrapper, a test double).
    /// `object_metadata` says whether it keeps user metadata on objects (S3, GCS and Azure do;
    /// `LocalFileSystem` and `InMemory` refuse it).
    pub fn from_store(store: Arc<dyn ObjectStore>, prefix: &str, object_metadata: bool) -> Destination {
        let prefix = ObjPath::from(prefix);
        let display = format!("{store}/{prefix}");
        Destination {
            store,
            multipart: None,
            prefix,
            backend: Backend::Custom { object_metadata },
            display,
            redactor: Redactor::new(&[]),
            uploads: None,
        }
    }

    /// The multipart uploads open under this prefix, keys relative to it; `None` where the store
    /// cannot list them (only S3 is listed: an Azure block blob's uncommitted blocks expire by
    /// themselves, and a local file system has no uploads).
    pub async fn open_uploads(&self) -> Result<Option<Vec<crate::OpenMultipart>>, PublishError> {
        let Some(lister) = &self.uploads else { return Ok(None) };
        let prefix = format!("{}/", self.prefix.as_ref());
        let mut open =
            lister.list(&prefix).await.map_err(|e| PublishError::Config(self.redactor.redact(&e.to_string())))?;
        for u in &mut open {
            u.key = u.key.strip_prefix(&prefix).unwrap_or(&u.key).to_string();
        }
        Ok(Some(open))
    }

    /// The store (for reading what was published).
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// The prefix `rel` (`/`-separated) under this one, in the same store.
    pub fn child(&self, rel: &str) -> Destination {
        let prefix = self.object(rel);
        let display = format!("{}/{}", self.display.trim_end_matches('/'), rel.trim_matches('/'));
        let backend = match &self.backend {
            Backend::Local(dir) => Backend::Local(dir.join(rel)),
            other => other.clone(),
        };
        Destination {
            store: self.store.clone(),
            multipart: self.multipart.clone(),
            prefix,
            backend,
            display,
            redactor: self.redactor.clone(),
            uploads: self.uploads.clone(),
        }
    }

    /// The store's multipart API, when it has one usable across processes (S3, GCS, Azure; not
    /// the local filesystem).
    pub fn multipart(&self) -> Option<&Arc<dyn MultipartStore>> {
        self.multipart.as_ref()
    }

    /// The prefix of the checkpoint's objects in the store.
    pub fn prefix(&self) -> &ObjPath {
        &self.prefix
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// `text` (an error of this store, say) without credentials: URL queries and user info, and
    /// the values of secret-looking options and `AWS_*`/`GOOGLE_*`/`AZURE_*` variables.
    pub fn redact(&self, text: &str) -> String {
        self.redactor.redact(text)
    }

    /// The object of the file `name` (a path relative to the checkpoint directory, `/`-separated).
    pub fn object(&self, name: &str) -> ObjPath {
        name.split('/').fold(self.prefix.clone(), |p, part| p.join(part))
    }

    /// Whether objects carry user metadata (the recorded SHA-256).
    pub(crate) fn object_metadata(&self) -> bool {
        match &self.backend {
            Backend::Local(_) => false,
            Backend::S3 | Backend::Gcs | Backend::Azure => true,
            Backend::Custom { object_metadata } => *object_metadata,
        }
    }

    /// The local file behind an object, for fsync.
    pub(crate) fn local_file(&self, name: &str) -> Option<PathBuf> {
        match &self.backend {
            Backend::Local(dir) => Some(dir.join(name)),
            _ => None,
        }
    }
}

fn unknown_key(k: &str) -> PublishError {
    PublishError::Config(format!("unknown store option `{k}`"))
}

/// Installs rustls' ring provider as the process default unless one is installed already
/// (object_store's HTTP client needs one; the build avoids aws-lc).
pub(crate) fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Removes credentials from text meant for errors and logs.
#[derive(Clone, Default)]
pub(crate) struct Redactor {
    secrets: Vec<String>,
}

/// Names of configuration entries whose values are secrets.
fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    ["secret", "token", "password", "key", "sas", "credential", "signature", "sig", "service_account"]
        .iter()
        .any(|w| n.contains(w))
        && !n.ends_with("_key_id")
        && !n.ends_with("access_key_id")
}

impl Redactor {
    pub(crate) fn new(options: &[(String, String)]) -> Redactor {
        let mut secrets: Vec<String> =
            options.iter().filter(|(k, _)| is_secret_name(k)).map(|(_, v)| v.clone()).collect();
        for (k, v) in std::env::vars() {
            if (k.starts_with("AWS_") || k.starts_with("GOOGLE_") || k.starts_with("AZURE_")) && is_secret_name(&k) {
                secrets.push(v);
            }
        }
        // Short values would blank out ordinary words; credentials are long.
        secrets.retain(|s| s.len() >= 6);
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets.dedup();
        Redactor { secrets }
    }

    pub(crate) fn redact(&self, text: &str) -> String {
        let mut out = strip_url_secrets(text);
        for s in &self.secrets {
            if out.contains(s.as_str()) {
                out = out.replace(s.as_str(), "[redacted]");
            }
        }
        out
    }
}

/// Drops the query (signatures, SAS tokens) and user info of every URL in `text`.
fn strip_url_secrets(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        out.push_str(&rest[..i + 3]);
        rest = &rest[i + 3..];
        let end = rest
            .find(|c: char| c.is_whitespace() || matches!(c, ')' | '"' | '\'' | '>' | '<' | ','))
            .unwrap_or(rest.len());
        let url = &rest[..end];
        let authority_end = url.find('/').unwrap_or(url.len());
        let (authority, path) = url.split_at(authority_end);
        match authority.rfind('@') {
            Some(at) => {
                out.push_str("[redacted]@");
                out.push_str(&authority[at + 1..]);
            }
            None => out.push_str(authority),
        }
        match path.find('?') {
            Some(q) => {
                out.push_str(&path[..q]);
                out.push_str("?[redacted]");
            }
            None => out.push_str(path),
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_queries_and_user_info() {
        let r = Redactor::new(&[("aws_secret_access_key".into(), "s3cr3t-value".into())]);
        let msg = "error sending request for url (https://acct.blob.core.windows.net/c/x?sv=1&sig=abc%2F) \
                   at s3://AKIA:s3cr3t-value@bucket/p: key s3cr3t-value";
        let got = r.redact(msg);
        assert!(!got.contains("sig=abc"), "{got}");
        assert!(!got.contains("s3cr3t-value"), "{got}");
        assert!(got.contains("https://acct.blob.core.windows.net/c/x?[redacted])"), "{got}");
        assert!(got.contains("s3://[redacted]@bucket/p"), "{got}");
    }

    #[test]
    fn schemes() {
        let d = Destination::open("file:///tmp/a/b", &[]).unwrap();
        assert_eq!(d.backend, Backend::Local(PathBuf::from("/tmp/a/b")));
        assert_eq!(d.object("x.distcp").as_ref(), "tmp/a/b/x.distcp");
        let opts = vec![
            ("aws_region".to_string(), "us-east-1".to_string()),
            ("aws_access_key_id".to_string(), "AKIDEXAMPLE".to_string()),
            ("aws_secret_access_key".to_string(), "very-secret-key".to_string()),
        ];
        let d = Destination::open("s3://bucket/runs/r1?x=1", &opts).unwrap();
        assert_eq!(d.backend, Backend::S3);
        assert_eq!(d.prefix.as_ref(), "runs/r1");
        assert_eq!(d.to_string(), "s3://bucket/runs/r1");
        assert!(!format!("{d:?}").contains("very-secret-key"));
        let d = Destination::open("gs://bucket/ckpt", &[("google_bucket".into(), "bucket".into())]).unwrap();
        assert_eq!(d.backend, Backend::Gcs);
        assert_eq!(d.prefix.as_ref(), "ckpt");
        let d = Destination::open(
            "az://container/ckpt/v1",
            &[
                ("azure_storage_account_name".into(), "acct".into()),
                ("azure_storage_account_key".into(), "a2V5".into()),
            ],
        )
        .unwrap();
        assert_eq!(d.backend, Backend::Azure);
        assert_eq!(d.prefix.as_ref(), "ckpt/v1");
        assert!(matches!(Destination::open("ftp://x/y", &[]), Err(PublishError::UnsupportedDestination(_))));
        assert!(matches!(Destination::open("relative/dir", &[]), Err(PublishError::UnsupportedDestination(_))));
        let e = Destination::open("s3://b/p", &[("aws_nonsense".into(), "v".into())]).unwrap_err();
        assert!(e.to_string().contains("aws_nonsense"), "{e}");
    }
}
