//! Download throughput of the Hub client against the local Hub server, next to `curl` fetching
//! the same files from the same server in the same run.
//!
//! ```text
//! cargo build --release && target/release/shardline synth --arch qwen3_moe --size 2GiB /tmp/rel
//! cargo run --release -p shardline-hub --example hub_throughput -- /tmp/rel [--concurrency 8] [--runs 2]
//! ```
//!
//! The server runs in a child process (this binary with `--serve`), so the client and `curl` are
//! measured against the same server process. The release is read once first so every run is
//! served from the page cache. Each run starts from an empty cache / output directory. The
//! client's time includes verifying every file (sha256 of the LFS shards); plain `curl` verifies
//! nothing, so `curl` followed by `openssl dgst -sha256` is timed too.
//! `--modes hub,hub1,curl,curl+sha256` picks what to time.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shardline_hub::fake::FakeHub;
use shardline_hub::{DownloadOptions, HubClient};

const REPO: &str = "bench/release";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--serve") {
        serve(Path::new(&args[1]));
        return;
    }
    let mut dir = None;
    let (mut concurrency, mut runs, mut part_mib) = (8usize, 2usize, 32u64);
    let mut modes: Vec<String> = ["hub", "hub1", "curl", "curl+sha256"].map(String::from).to_vec();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--concurrency" => concurrency = it.next().expect("value").parse().expect("number"),
            "--runs" => runs = it.next().expect("value").parse().expect("number"),
            "--part-size-mib" => part_mib = it.next().expect("value").parse().expect("number"),
            "--modes" => modes = it.next().expect("value").split(',').map(str::to_owned).collect(),
            _ => dir = Some(PathBuf::from(a)),
        }
    }
    let dir = dir.expect(
        "usage: hub_throughput RELEASE_DIR [--concurrency N] [--runs N] [--part-size-mib N] [--modes hub,hub1,curl,curl+sha256]",
    );
    let files = list(&dir);
    let total: u64 = files.iter().map(|(_, n)| n).sum();
    println!("release {}: {} files, {:.3} GB", dir.display(), files.len(), total as f64 / 1e9);

    // The server, in its own process.
    let mut server = Server(
        Command::new(std::env::current_exe().unwrap())
            .arg("--serve")
            .arg(&dir)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the server"),
    );
    let mut line = String::new();
    BufReader::new(server.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let mut words = line.split_whitespace().skip(1);
    let (endpoint, sha) = (words.next().expect("endpoint").to_owned(), words.next().expect("sha").to_owned());
    println!("server {endpoint}, commit {sha}");

    // Warm the page cache so every run reads the release from memory.
    for (p, _) in &files {
        std::io::copy(&mut std::fs::File::open(dir.join(p)).unwrap(), &mut std::io::sink()).unwrap();
    }

    let work = tempfile::Builder::new()
        .prefix("hub-throughput")
        .tempdir_in(dir.parent().unwrap_or(Path::new("/tmp")))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = HubClient::new(&endpoint, None).unwrap();
    let hub_run = |c: usize| {
        let cache = work.path().join("cache");
        let opts = DownloadOptions {
            cache_dir: Some(cache.clone()),
            concurrency: c,
            part_size: part_mib << 20,
            ..Default::default()
        };
        let t = Instant::now();
        let snap = rt.block_on(client.download(REPO, &sha, &opts)).expect("download");
        let el = t.elapsed();
        assert_eq!(snap.bytes_downloaded, total);
        std::fs::remove_dir_all(&cache).unwrap();
        el
    };
    // `verify`: then hash every file with `openssl dgst -sha256` (SHA-NI), as a user checking the
    // download against the Hub's sha256 would.
    let curl_run = |parallel: usize, verify: bool| {
        let out = work.path().join("curl");
        std::fs::create_dir_all(&out).unwrap();
        let mut cfg = String::new();
        for (p, _) in &files {
            cfg.push_str(&format!(
                "url = \"{endpoint}/{REPO}/resolve/{sha}/{p}\"\noutput = \"{}\"\n",
                out.join(p).display()
            ));
        }
        let cfg_path = work.path().join("curl.cfg");
        std::fs::File::create(&cfg_path).unwrap().write_all(cfg.as_bytes()).unwrap();
        let t = Instant::now();
        let st = Command::new("curl")
            .args([
                "-s",
                "-S",
                "--no-progress-meter",
                "-f",
                "-L",
                "--create-dirs",
                "--parallel",
                "--parallel-max",
                &parallel.to_string(),
                "-K",
            ])
            .arg(&cfg_path)
            .status()
            .expect("run curl");
        let el = t.elapsed();
        assert!(st.success(), "curl failed");
        let got: u64 = files.iter().map(|(p, _)| std::fs::metadata(out.join(p)).unwrap().len()).sum();
        assert_eq!(got, total);
        let el = if verify {
            let st = Command::new("openssl")
                .args(["dgst", "-sha256"])
                .args(files.iter().map(|(p, _)| out.join(p)))
                .stdout(Stdio::null())
                .status()
                .expect("run openssl");
            assert!(st.success(), "openssl failed");
            t.elapsed()
        } else {
            el
        };
        std::fs::remove_dir_all(&out).unwrap();
        el
    };

    let on = |m: &str| modes.iter().any(|x| x == m);
    let keys = ["hub", "hub1", "curl", "curl+sha256"];
    let labels = [
        format!("shardline-hub, {concurrency} streams, {part_mib} MiB ranges, sha256-verified"),
        "shardline-hub, 1 stream, sha256-verified".to_owned(),
        format!("curl, up to {concurrency} files at once, unverified"),
        "curl, then openssl dgst -sha256 (the verification users do)".to_owned(),
    ];
    let mut best = [Duration::MAX; 4];
    for run in 1..=runs {
        let mut line = format!("run {run}:");
        for (i, k) in keys.iter().enumerate() {
            if !on(k) {
                continue;
            }
            let d = match i {
                0 => hub_run(concurrency),
                1 => hub_run(1),
                2 => curl_run(concurrency, false),
                _ => curl_run(concurrency, true),
            };
            best[i] = best[i].min(d);
            line.push_str(&format!("  {k} {:.2}s", d.as_secs_f64()));
        }
        println!("{line}");
    }
    let gbs = |d: Duration| total as f64 / 1e9 / d.as_secs_f64();
    println!("best of {runs}:");
    for i in 0..4 {
        if on(keys[i]) {
            println!("  {:<64} {:>6.2}s {:>6.2} GB/s", labels[i], best[i].as_secs_f64(), gbs(best[i]));
        }
    }
    for (i, j) in [(0, 2), (1, 2), (0, 3), (1, 3)] {
        if on(keys[i]) && on(keys[j]) {
            println!("  time {} / {}: {:.2}", keys[i], keys[j], best[i].as_secs_f64() / best[j].as_secs_f64());
        }
    }
    drop(server);
}

/// The server process, killed when the measurement ends (or panics).
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn list(dir: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((
                    p.strip_prefix(dir).unwrap().to_string_lossy().into_owned(),
                    std::fs::metadata(&p).unwrap().len(),
                ));
            }
        }
    }
    out.sort();
    out
}

fn serve(dir: &Path) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let hub = FakeHub::start().await.unwrap();
        let sha = hub.publish_dir(REPO, dir).unwrap();
        println!("ENDPOINT {} {sha}", hub.endpoint());
        std::io::stdout().flush().unwrap();
        // Serve until the parent kills us.
        std::future::pending::<()>().await;
    });
}
