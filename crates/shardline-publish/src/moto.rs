//! moto's S3 server for tests (feature `test-server`): started from the repository's `.venv` on
//! 127.0.0.1 and killed on drop. It also exits by itself when the test process goes away (it
//! watches its stdin, a pipe from us, for end of file). Tests of this crate, of the engine and of
//! the binary run against it; they fail, never skip, when `.venv` or moto is missing
//! (`scripts/setup-python` installs them).

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The repository root (this crate lives in `crates/shardline-publish`).
pub fn repo_root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.canonicalize().unwrap_or(root)
}

/// The repository venv's Python; panics (the test fails) when it is missing.
pub fn venv_python() -> PathBuf {
    let python = repo_root().join(".venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: the S3 tests need the repository's venv with moto[server], boto3 and torch \
         (run scripts/setup-python)",
        python.display()
    );
    python
}

/// A running moto S3 server.
pub struct Moto {
    child: Child,
    pub port: u16,
    /// The server's log (one line per request).
    pub log: PathBuf,
}

const MOTO_MAIN: &str = r#"
import os, sys, threading
def watch_parent():
    sys.stdin.read()
    os._exit(0)
threading.Thread(target=watch_parent, daemon=True).start()
from moto.server import main
main(["-H", "127.0.0.1", "-p", sys.argv[1]])
"#;

/// The credentials the tests use (moto accepts any).
pub const ACCESS_KEY_ID: &str = "testing";
pub const SECRET_ACCESS_KEY: &str = "testing-secret";
pub const REGION: &str = "us-east-1";

impl Moto {
    /// Starts the server, its log in `dir`; panics (the test fails, never skips) when `.venv` or
    /// moto is missing or the server does not come up.
    pub fn start(dir: &Path) -> Moto {
        let python = venv_python();
        let check = Command::new(&python).args(["-c", "import moto.server, boto3"]).output();
        match check {
            Ok(o) if o.status.success() => {}
            Ok(o) => panic!(
                "moto[server] is not installed in .venv (run scripts/setup-python): {}",
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => panic!("cannot run {}: {e}", python.display()),
        }
        let mut last_log = String::new();
        for attempt in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .unwrap_or_else(|e| panic!("no free port on 127.0.0.1: {e}"));
            let log = dir.join(format!("moto-{attempt}.log"));
            let out = fs::File::create(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
            let err = out.try_clone().unwrap_or_else(|e| panic!("{}: {e}", log.display()));
            let mut child = Command::new(&python)
                .args(["-c", MOTO_MAIN, &port.to_string()])
                .stdin(Stdio::piped())
                .stdout(out)
                .stderr(err)
                .spawn()
                .unwrap_or_else(|e| panic!("start moto: {e}"));
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if let Ok((200, _)) = http(port, "GET", "/") {
                    return Moto { child, port, log };
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
            last_log = fs::read_to_string(&log).unwrap_or_default();
        }
        panic!("moto did not start on 127.0.0.1 after 3 attempts; its log:\n{last_log}");
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A request to the server (moto takes unsigned requests): status and whole response.
    pub fn http(&self, method: &str, path: &str) -> std::io::Result<(u16, String)> {
        http(self.port, method, path)
    }

    /// Creates a bucket.
    pub fn create_bucket(&self, bucket: &str) {
        let (status, body) = self.http("PUT", &format!("/{bucket}")).unwrap_or_else(|e| panic!("moto: {e}"));
        assert_eq!(status, 200, "create bucket {bucket}: {body}");
    }

    /// The keys under `prefix` (a plain ListObjectsV2 request).
    pub fn list_keys(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let (status, body) =
            self.http("GET", &format!("/{bucket}?list-type=2&prefix={prefix}")).unwrap_or_else(|e| panic!("moto: {e}"));
        assert_eq!(status, 200, "{body}");
        body.split("<Key>").skip(1).filter_map(|s| s.split("</Key>").next()).map(str::to_string).collect()
    }

    /// The keys under `prefix` with their sizes (one ListObjectsV2 request).
    pub fn list_sizes(&self, bucket: &str, prefix: &str) -> std::collections::BTreeMap<String, u64> {
        let (status, body) =
            self.http("GET", &format!("/{bucket}?list-type=2&prefix={prefix}")).unwrap_or_else(|e| panic!("moto: {e}"));
        assert_eq!(status, 200, "{body}");
        let field = |item: &str, tag: &str| {
            item.split(&format!("<{tag}>"))
                .nth(1)
                .and_then(|r| r.split(&format!("</{tag}>")).next())
                .map(str::to_string)
        };
        body.split("<Contents>")
            .skip(1)
            .filter_map(|item| Some((field(item, "Key")?, field(item, "Size")?.parse().ok()?)))
            .collect()
    }

    /// Multipart uploads started and neither completed nor aborted.
    pub fn open_multipart_uploads(&self, bucket: &str) -> usize {
        let (status, body) = self.http("GET", &format!("/{bucket}?uploads")).unwrap_or_else(|e| panic!("moto: {e}"));
        assert_eq!(status, 200, "{body}");
        body.matches("<UploadId>").count()
    }

    /// Configuration for object_store (as `PublishOptions::store_options`).
    pub fn store_options(&self) -> Vec<(String, String)> {
        vec![
            ("aws_endpoint".into(), self.endpoint()),
            ("aws_allow_http".into(), "true".into()),
            ("aws_region".into(), REGION.into()),
            ("aws_access_key_id".into(), ACCESS_KEY_ID.into()),
            ("aws_secret_access_key".into(), SECRET_ACCESS_KEY.into()),
        ]
    }

    /// The same configuration as environment variables, as object_store's `from_env` reads them
    /// (for a `shardline` process).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_REGION", REGION.into()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY.into()),
        ]
    }

    /// The requests the server answered so far, in order: (method, path with query, status).
    pub fn requests(&self) -> Vec<(String, String, u16)> {
        let text = strip_ansi(&fs::read_to_string(&self.log).unwrap_or_default());
        text.lines()
            .filter_map(|l| {
                let start = l.find('"')? + 1;
                let rest = &l[start..];
                let end = rest.find('"')?;
                let mut words = rest[..end].split_whitespace();
                let method = words.next()?.to_string();
                let path = words.next()?.to_string();
                let status = rest[end + 1..].split_whitespace().next()?.parse().ok()?;
                Some((method, path, status))
            })
            .collect()
    }

    /// Requests that change objects (PUT, POST, DELETE), as "METHOD key" without the query, but
    /// for DeleteObjects (object_store's deletes), which shows as "POST /bucket?delete" (the
    /// keys are in the body).
    pub fn writes_since(&self, from: usize) -> Vec<String> {
        self.requests()
            .get(from..)
            .unwrap_or_default()
            .iter()
            .filter(|(m, _, _)| m == "PUT" || m == "POST" || m == "DELETE")
            .map(|(m, p, _)| match p.split_once('?') {
                Some((path, "delete" | "delete=")) => format!("{m} {path}?delete"),
                Some((path, _)) => format!("{m} {path}"),
                None => format!("{m} {p}"),
            })
            .collect()
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The server colours the log lines of answers other than 200 (ANSI escapes).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A minimal HTTP/1.1 request to 127.0.0.1:port.
fn http(port: u16, method: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad response: {resp}")))?;
    Ok((status, resp))
}
