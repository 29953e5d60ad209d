//! The path policy of a real `shardline server --allow-source … --allow-dest …`: every escape
//! attempt submitted through the API is refused with an error at its line and nothing is written
//! outside the roots; an allowed submission runs and publishes under its root.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::procs::{cmd, spawn};
use crate::{fixture, run, stderr, stdout};

const WAIT: Duration = Duration::from_secs(90);

/// `POST path` with a JSON body and a bearer token: (status code, body).
fn post(addr: &str, path: &str, token: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    request(addr, "POST", path, token, &body.to_string())
}

fn get(addr: &str, path: &str, token: &str) -> (u16, serde_json::Value) {
    request(addr, "GET", path, token, "")
}

fn request(addr: &str, method: &str, path: &str, token: &str, body: &str) -> (u16, serde_json::Value) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("request");
    let mut response = String::new();
    s.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, serde_json::from_str(body).unwrap_or(serde_json::Value::Null))
}

fn spec(source: &str, dest: &str) -> String {
    format!(
        "apiVersion: shardline/v1\nkind: Pipeline\nname: policed\nsteps:\n\
         \x20 - id: download\n    uses: hf.download\n    with: {{path: \"{source}\"}}\n\
         \x20 - id: shard\n    uses: megatron.shard\n    needs: [download]\n    with: {{tp: 2, dp: 1}}\n\
         \x20 - id: upload\n    uses: store.upload\n    needs: [shard]\n    with: {{to: \"{dest}\"}}\n"
    )
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                dirs.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[test]
fn api_submissions_outside_the_roots_are_refused_at_their_line_and_an_allowed_one_runs() {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    // The roots: a releases directory (with the fixture in it) and an output directory. Next to
    // them, what a spec must not reach: a secret directory, and a link into it from inside.
    let releases = d.join("releases");
    let out = d.join("out");
    let outside = d.join("outside");
    for p in [&releases, &out, &outside] {
        std::fs::create_dir_all(p).expect("mkdir");
    }
    let model = releases.join("qwen3_next");
    std::fs::create_dir_all(&model).expect("mkdir");
    for e in std::fs::read_dir(fixture("qwen3_next")).expect("fixture") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), model.join(e.file_name())).expect("copy fixture");
    }
    std::fs::write(outside.join("secret.txt"), "x").expect("secret");
    std::os::unix::fs::symlink(&outside, releases.join("link")).expect("symlink");
    std::os::unix::fs::symlink(&outside, out.join("link")).expect("symlink");

    let o = run(&mut cmd(d, &["token", "create", "--scope", "submit", "--name", "teammate"]));
    assert!(o.status.success(), "token create: {}", stderr(&o));
    let token = stdout(&o).trim().to_string();
    let server = spawn(
        d,
        "server",
        &[
            "server",
            "--http",
            "127.0.0.1:0",
            "--allow-source",
            &releases.display().to_string(),
            "--allow-dest",
            &format!("file://{}", out.display()),
        ],
    );
    let addr = server.wait_for_address();

    let r = releases.display().to_string();
    let o = out.display().to_string();
    let x = outside.display().to_string();
    let good_source = model.display().to_string();
    let good_dest = format!("file://{o}/published");
    // (source, dest, the line the refusal must name)
    let escapes: Vec<(String, String, usize)> = vec![
        (x.clone(), good_dest.clone(), 7),
        (format!("{r}/../outside"), good_dest.clone(), 7),
        (format!("{r}/link"), good_dest.clone(), 7),
        (format!("{r}/%2e%2e/outside"), good_dest.clone(), 7),
        (format!("file://{x}"), good_dest.clone(), 7),
        (format!("file://{r}/%2e%2e/outside"), good_dest.clone(), 7),
        ("relative/qwen3_next".to_string(), good_dest.clone(), 7),
        (good_source.clone(), format!("file://{x}/stolen"), 15),
        (good_source.clone(), format!("{x}/stolen"), 15),
        (good_source.clone(), format!("file://{o}/../outside/stolen"), 15),
        (good_source.clone(), format!("file://{o}/link/stolen"), 15),
        (good_source.clone(), format!("file://{o}/%2e%2e/outside"), 15),
        (good_source.clone(), "s3://bucket/anywhere".to_string(), 15),
    ];
    for (source, dest, line) in &escapes {
        let (status, body) = post(&addr, "/api/v1/runs", &token, &serde_json::json!({"spec": spec(source, dest)}));
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(status, 422, "{source} → {dest} was not refused: {body}");
        assert!(
            message.contains(&format!("pipeline.yaml:{line}:")),
            "{source} → {dest}: not at line {line}: {message}"
        );
    }
    // A command step needs --allow-commands, which this server was not given.
    let command = format!(
        "{}  - id: check\n    uses: command\n    needs: [upload]\n    with: {{run: [touch, {x}/pwned]}}\n",
        spec(&good_source, &good_dest)
    );
    let (status, body) = post(&addr, "/api/v1/runs", &token, &serde_json::json!({"spec": command}));
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(status, 422, "a command step was accepted: {body}");
    assert!(message.contains("pipeline.yaml:17:") && message.contains("does not run command steps"), "{message}");
    // Nothing was written outside the roots, and no run was created.
    assert_eq!(files_under(&outside), vec![outside.join("secret.txt")]);
    let (status, body) =
        post(&addr, "/api/v1/runs", &token, &serde_json::json!({"spec": spec(&good_source, &good_dest)}));
    assert_eq!(status, 201, "the allowed submission: {body}");
    let run_id = body["run"].as_i64().unwrap_or_else(|| panic!("run id in {body}"));
    assert_eq!(run_id, 1, "the refused submissions created runs");

    let _worker = spawn(d, "worker", &["worker", "--name", "w1"]);
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, v) = get(&addr, &format!("/api/v1/runs/{run_id}"), &token);
        let state = v["run"]["state"].as_str().unwrap_or("").to_string();
        if state == "succeeded" {
            break;
        }
        assert!(!matches!(state.as_str(), "failed" | "cancelled"), "the allowed run ended {state}: {v}");
        assert!(Instant::now() < deadline, "the allowed run did not finish: {v}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let published = files_under(&out.join("published"));
    assert!(published.iter().any(|p| p.ends_with(".metadata")), "nothing published under the root: {published:?}");
    assert_eq!(files_under(&outside), vec![outside.join("secret.txt")]);
}
