//! Workers that share no disk: a server and three workers, each with a `--state-dir` of its own,
//! on one PostgreSQL database, with a real S3-compatible server (moto) as the only medium the
//! data passes through (`--artifacts s3://…`). The release comes from a local Hub server.
//!
//! Also: a worker killed with `kill -9` while its rank file's multipart upload is open. The run
//! completes on the others, the reaper aborts the dead upload (and the server's sweep one no task
//! recorded), and no object of the checkpoint is ever listed but complete rank files (the uploads
//! stay open until the commit completes them).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use shardline_hub::fake::FakeHub;
use shardline_publish::moto::{repo_root, Moto};
use shardline_store::{LogFilter, RunId, RunRow, RunState, Store, TaskState};
use shardline_testdb::TestDb;

use crate::orchestrator::synth;
use crate::{bin, fixture, run, stderr, stdout};

mod reshard;

/// How long a run may take before a test gives up on it: a backstop against a hung run, never
/// what a test waits for (it waits for the run's state). Generous, because these runs move
/// hundreds of megabytes through the S3 test server with several workers on a machine that may
/// be running the rest of the suite too (a run of the ranged-read test took 185 s there).
const WAIT: Duration = Duration::from_secs(600);
const ARTIFACTS: &str = "artifacts";
const CHECKPOINTS: &str = "checkpoints";
const REPO: &str = "acme/tiny-qwen3-next";

/// Processes on separate state directories, killed when dropped (their logs shown on failure).
struct Hosts {
    dir: tempfile::TempDir,
    url: String,
    env: Vec<(&'static str, String)>,
    procs: std::sync::Mutex<BTreeMap<String, (Child, PathBuf)>>,
    rt: tokio::runtime::Runtime,
    store: Store,
    _db: TestDb,
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let procs = self.procs.get_mut().unwrap_or_else(|e| e.into_inner());
        for (name, (child, log)) in procs {
            let _ = child.kill();
            let _ = child.wait();
            if std::thread::panicking() {
                eprintln!("---- {name} ----\n{}", std::fs::read_to_string(log).unwrap_or_default());
            }
        }
    }
}

impl Hosts {
    fn new(moto: &Moto, hub: Option<&FakeHub>) -> Hosts {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let db = rt.block_on(TestDb::postgres(false));
        let store = rt.block_on(db.store());
        let mut env = moto.env();
        if let Some(hub) = hub {
            env.push(("HF_ENDPOINT", hub.endpoint()));
        }
        Hosts {
            dir: tempfile::tempdir().expect("temp dir"),
            url: db.url.clone(),
            env,
            procs: Default::default(),
            rt,
            store,
            _db: db,
        }
    }

    /// `shardline ARGS` as host `host` runs it: its own state directory and HF cache.
    fn cmd(&self, host: &str, args: &[&str]) -> Command {
        let home = self.dir.path().join(host);
        std::fs::create_dir_all(&home).expect("host dir");
        let mut c = bin();
        c.args(args)
            .arg("--database-url")
            .arg(&self.url)
            .arg("--state-dir")
            .arg(home.join("state"))
            .arg("--artifacts")
            .arg(format!("s3://{ARTIFACTS}/shardline"))
            .current_dir(&home)
            .env("HF_HOME", home.join("hf"))
            .env_remove("HF_HUB_CACHE")
            .env_remove("HF_TOKEN")
            .env_remove("SHARDLINE_DATABASE_URL")
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())));
        c
    }

    fn spawn(&mut self, host: &str, args: &[&str]) {
        let log = self.dir.path().join(format!("{host}.log"));
        let out = File::create(&log).expect("log");
        let child = self
            .cmd(host, args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {host}: {e}"));
        self.procs.lock().expect("procs").insert(host.to_string(), (child, log));
    }

    /// A server and workers named `workers`, on the one database and store.
    fn started(moto: &Moto, hub: Option<&FakeHub>, workers: &[&str]) -> Hosts {
        let mut hosts = Hosts::new(moto, hub);
        hosts.spawn("server", &["server"]);
        for w in workers {
            hosts.worker(w);
        }
        hosts
    }

    fn worker(&mut self, host: &str) {
        self.spawn(host, &["worker", "--name", host, "--cpus", "2", "--lease-seconds", "3"]);
    }

    fn kill9(&self, host: &str) {
        let mut procs = self.procs.lock().expect("procs");
        let (child, _) = procs.get_mut(host).unwrap_or_else(|| panic!("no host {host}"));
        child.kill().expect("kill -9");
        let _ = child.wait();
    }

    fn submit(&self, spec: &Path, set: &[String]) -> RunId {
        let mut c = self.cmd("client", &["submit"]);
        c.arg(spec);
        for s in set {
            c.args(["--set", s]);
        }
        let o = run(&mut c);
        assert!(o.status.success(), "submit: {}\n{}", stdout(&o), stderr(&o));
        RunId(stdout(&o).trim().parse().unwrap_or_else(|e| panic!("run id `{}`: {e}", stdout(&o))))
    }

    fn run_row(&self, run: RunId) -> RunRow {
        self.rt.block_on(self.store.get_run(run)).expect("store").expect("run")
    }

    fn wait_run(&self, run: RunId) -> RunRow {
        self.wait_run_with(run, || {})
    }

    /// Waits for `run` to end, calling `each` between looks.
    fn wait_run_with(&self, run: RunId, mut each: impl FnMut()) -> RunRow {
        let deadline = Instant::now() + WAIT;
        loop {
            let r = self.run_row(run);
            if matches!(r.state, RunState::Succeeded | RunState::Failed | RunState::Cancelled) {
                return r;
            }
            assert!(Instant::now() < deadline, "run {run} did not end within {WAIT:?}: {r:?}");
            each();
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The workers that ran each task (succeeded attempts), by task name.
    fn ran_by(&self, run: RunId) -> BTreeMap<String, String> {
        let tasks = self.rt.block_on(self.store.run_tasks(run)).expect("tasks");
        let mut out = BTreeMap::new();
        for t in tasks {
            let attempts = self.rt.block_on(self.store.task_attempts(t.id)).expect("attempts");
            if let Some(a) = attempts.iter().find(|a| a.outcome == Some(shardline_store::AttemptOutcome::Succeeded)) {
                out.insert(t.name.clone(), a.worker_name.clone());
            }
        }
        out
    }
}

#[test]
fn three_workers_without_a_shared_disk_convert_validate_and_publish() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let hub = runtime.block_on(FakeHub::start()).expect("start the local Hub");
    let sha = hub.publish_dir(REPO, &fixture("qwen3_next")).expect("publish the fixture");
    let moto = Moto::start(tmp.path());
    moto.create_bucket(ARTIFACTS);
    moto.create_bucket(CHECKPOINTS);
    let hosts = Hosts::started(&moto, Some(&hub), &["host-a", "host-b", "host-c"]);
    let pipeline = repo_root().join("pipelines/hub-qwen3.yaml");
    let run = hosts.submit(
        &pipeline,
        &[format!("repo={REPO}"), "tp=2".into(), "dp=4".into(), format!("dest=s3://{CHECKPOINTS}/published")],
    );
    let row = hosts.wait_run(run);
    assert_eq!(row.state, RunState::Succeeded, "{:?}", row.error);
    let name = row.options.name.clone().expect("run name");

    // Every worker ran rank tasks; all eight ranks ran somewhere.
    let ran = hosts.ran_by(run);
    let rank_hosts: BTreeSet<&String> = ran.iter().filter(|(t, _)| t.contains("/rank-")).map(|(_, w)| w).collect();
    assert_eq!(ran.keys().filter(|t| t.contains("/rank-")).count(), 8, "{ran:?}");
    assert_eq!(rank_hosts.len(), 3, "every worker ran some rank tasks: {ran:?}");

    // The data went through the artifact store: the release once, the checkpoint under the run.
    let art = moto.list_keys(ARTIFACTS, "shardline/");
    let ckpt: Vec<&String> = art.iter().filter(|k| k.contains(&format!("runs/{name}/shard/checkpoint/"))).collect();
    assert_eq!(ckpt.len(), 9, "8 rank files and .metadata: {art:?}");
    assert!(art.iter().any(|k| k.contains("/releases/") && k.ends_with("/shardline-release.json")), "{art:?}");
    assert_eq!(moto.open_multipart_uploads(ARTIFACTS), 0, "no upload may stay open");
    assert_eq!(moto.open_multipart_uploads(CHECKPOINTS), 0);
    let open = hosts.rt.block_on(hosts.store.open_uploads(run)).expect("uploads");
    assert!(open.is_empty(), "{open:?}");
    let tasks = hosts.rt.block_on(hosts.store.run_tasks(run)).expect("tasks");
    let validate = tasks.iter().find(|t| t.name == "validate").expect("validate task");
    assert_eq!(validate.state, TaskState::Succeeded);
    assert_eq!(validate.output.as_ref().expect("output")["ok"], true);
    // Validation was split by rank file across the workers; the parts checked every byte.
    let parts: Vec<_> = tasks.iter().filter(|t| t.name.starts_with("validate/part-")).collect();
    assert_eq!(parts.len(), 8, "one part per rank file");
    assert!(parts.iter().all(|t| t.state == TaskState::Succeeded));
    let part_hosts: BTreeSet<&String> =
        ran.iter().filter(|(t, _)| t.starts_with("validate/part-")).map(|(_, w)| w).collect();
    assert!(part_hosts.len() >= 2, "parts ran on several workers: {ran:?}");
    let checked =
        |t: &shardline_store::TaskRow| t.output.as_ref().and_then(|o| o["bytes_checked"].as_u64()).unwrap_or(0);
    assert!(parts.iter().all(|t| checked(t) > 0));
    assert_eq!(checked(validate), parts.iter().map(|t| checked(t)).sum::<u64>());
    // Each part was claimed with the scratch its files take: `.metadata`, its rank file, and as
    // much again for the release ranges they are made from.
    let sizes = moto.list_sizes(ARTIFACTS, &format!("shardline/runs/{name}/shard/checkpoint/"));
    let size = |file: &str| sizes.iter().find(|(k, _)| k.ends_with(&format!("/{file}"))).map(|(_, s)| *s);
    for t in &parts {
        let files = t.output.as_ref().and_then(|o| o["files"].as_array().cloned()).expect("the part's files");
        assert_eq!(files.len(), 1, "{}: one rank file per part", t.name);
        let file = size(files[0].as_str().expect("name")).expect("the part's file in the store");
        assert_eq!(t.resources.scratch, size(".metadata").expect(".metadata") + 2 * file, "{}", t.name);
    }

    // The published checkpoint, read back from S3, loads in torch and equals the reference.
    let prefix = format!("published/{name}");
    let summary = crate::hub_s3::load_published(&moto, CHECKPOINTS, &prefix, &tmp.path().join("downloaded"));
    assert_eq!(summary["objects"], 10, "{summary}");
    assert_eq!(summary["problems"], serde_json::json!([]), "{summary}");
    assert_eq!(summary["source"]["sha"], sha.as_str(), "{summary}");

    // Retention of the artifact store: the finished run's prefix goes, the release copy stays.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let run_prefix = format!("shardline/runs/{name}/");
    let gc = |dry: bool| {
        let mut c = hosts.cmd("client", &["gc", "--json", "--retain-runs", "1s"]);
        if dry {
            c.arg("--dry-run");
        }
        let o = crate::run(&mut c);
        assert!(o.status.success(), "gc: {}\n{}", stdout(&o), stderr(&o));
        serde_json::from_str::<Value>(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)))
    };
    let dry = gc(true);
    let items = dry["artifacts"]["items"].as_array().expect("artifact items").clone();
    assert_eq!(items.len(), 1, "{dry}");
    assert_eq!(items[0]["freed"], true, "{dry}");
    let listed: u64 = moto.list_sizes(ARTIFACTS, &run_prefix).values().sum();
    assert_eq!(items[0]["bytes"].as_u64(), Some(listed), "the item's size is the prefix's: {dry}");
    assert!(!moto.list_keys(ARTIFACTS, &run_prefix).is_empty(), "a dry run deletes nothing");
    gc(false);
    assert!(moto.list_keys(ARTIFACTS, &run_prefix).is_empty(), "the finished run's prefix was freed");
    assert!(!moto.list_keys(ARTIFACTS, "shardline/releases/").is_empty(), "release copies are kept");
    drop(hosts);
    drop(runtime);
}

#[test]
fn a_worker_killed_during_its_multipart_upload_leaves_nothing_partial() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let source = synth("qwen3", "200MB");
    let moto = Moto::start(tmp.path());
    moto.create_bucket(ARTIFACTS);
    // An upload whose worker died before recording it: only the store's own list shows it.
    let orphan = shardline_artifacts::Artifacts::open(
        &format!("s3://{ARTIFACTS}/shardline/runs/an-earlier-run/shard/checkpoint"),
        &moto.store_options(),
    )
    .expect("artifacts");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(orphan.begin_upload("__0_0.distcp", |_| async { true })).expect("an unrecorded upload");
    assert_eq!(moto.open_multipart_uploads(ARTIFACTS), 1);
    let hosts = Hosts::started(&moto, None, &["host-a", "host-b"]);
    let spec = tmp.path().join("killed.yaml");
    std::fs::write(
        &spec,
        format!(
            "apiVersion: shardline/v1\nkind: Pipeline\nname: killed\nsteps:\n\
             \x20 - {{id: download, uses: hf.download, with: {{path: \"{}\"}}}}\n\
             \x20 - {{id: shard, uses: megatron.shard, needs: [download], with: {{tp: 1, dp: 2}}, retry: {{lost: 3}}}}\n",
            source.display()
        ),
    )
    .expect("spec");
    let run = hosts.submit(&spec, &[]);
    let name = hosts.run_row(run).options.name.expect("run name");
    let ckpt_prefix = format!("shardline/runs/{name}/shard/checkpoint/");

    // Kill the first worker seen with an open upload whose task it still holds; meanwhile record
    // every object listed under the checkpoint with its size.
    let mut killed: Option<String> = None;
    let mut listed: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    let row = hosts.wait_run_with(run, || {
        for (key, size) in moto.list_sizes(ARTIFACTS, &ckpt_prefix) {
            listed.entry(key).or_default().insert(size);
        }
        if killed.is_none() {
            if let Some((victim, what)) = uploading_worker(&hosts, run) {
                eprintln!("killing {victim} while it uploads {what}");
                hosts.kill9(&victim);
                killed = Some(victim);
            }
        }
    });
    let victim = killed.expect("no worker was caught with an open upload: the test tested nothing");
    assert_eq!(row.state, RunState::Succeeded, "{:?}", row.error);
    // The killed attempt was lost and its task done again by the other worker.
    let ran = hosts.ran_by(run);
    let tasks = hosts.rt.block_on(hosts.store.run_tasks(run)).expect("tasks");
    let lost: Vec<String> = tasks
        .iter()
        .filter(|t| {
            let attempts = hosts.rt.block_on(hosts.store.task_attempts(t.id)).expect("attempts");
            attempts
                .iter()
                .any(|a| a.worker_name == victim && a.outcome == Some(shardline_store::AttemptOutcome::Expired))
        })
        .map(|t| t.name.clone())
        .collect();
    assert!(!lost.is_empty(), "{victim}'s attempt was not recorded as lost");
    for t in &lost {
        assert_ne!(ran.get(t), Some(&victim), "`{t}` succeeded on the killed worker");
    }

    // The dead upload is aborted by the reaper, the unrecorded one by the server's sweep of the
    // store's open uploads: none stays open.
    let deadline = Instant::now() + Duration::from_secs(30);
    while moto.open_multipart_uploads(ARTIFACTS) > 0 {
        assert!(Instant::now() < deadline, "an aborted worker's upload is still open on the server");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(hosts.rt.block_on(hosts.store.open_uploads(run)).expect("uploads").is_empty());

    // Every object ever listed under the checkpoint had one size: its complete one.
    let finals = moto.list_sizes(ARTIFACTS, &ckpt_prefix);
    assert_eq!(finals.len(), 3, "2 rank files and .metadata: {finals:?}");
    for (key, sizes) in &listed {
        assert_eq!(sizes.len(), 1, "`{key}` was listed with sizes {sizes:?}");
        assert_eq!(finals.get(key), sizes.iter().next(), "`{key}` was listed at another size than its final one");
    }
}

/// A worker holding a task whose multipart upload is open, and what it uploads.
fn uploading_worker(hosts: &Hosts, run: RunId) -> Option<(String, String)> {
    let open = hosts.rt.block_on(hosts.store.open_uploads(run)).expect("uploads");
    for u in open {
        let task = hosts.rt.block_on(hosts.store.task(shardline_store::TaskId(u.task_id))).expect("task");
        let Some(task) = task.filter(|t| t.state == TaskState::Leased) else { continue };
        let attempts = hosts.rt.block_on(hosts.store.task_attempts(task.id)).expect("attempts");
        if let Some(a) = attempts.iter().rev().find(|a| a.outcome.is_none()) {
            return Some((a.worker_name.clone(), format!("`{}` ({})", u.object_key, task.name)));
        }
    }
    None
}

/// `pipelines/reshard-export.yaml` on two workers that share no disk: the reshard and the export
/// read their inputs back from the artifact store and put what they write there; the uploaded
/// checkpoint validates against the release and the export holds the release's tensors.
#[test]
fn reshard_and_export_run_on_the_artifact_store() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let moto = Moto::start(tmp.path());
    moto.create_bucket(ARTIFACTS);
    let hosts = Hosts::started(&moto, None, &["host-a", "host-b"]);
    let out = tmp.path().join("out");
    let dest = format!("file://{}", out.display());
    let spec = repo_root().join("pipelines/reshard-export.yaml");
    let run = hosts.submit(
        &spec,
        &[
            format!("model={}", fixture("qwen3_moe").display()),
            format!("checkpoint_dest={dest}"),
            format!("hf_dest={dest}"),
        ],
    );
    let row = hosts.wait_run(run);
    assert_eq!(row.state, RunState::Succeeded, "{:?}", row.error);
    let name = row.options.name.clone().expect("run name");
    let art = moto.list_keys(ARTIFACTS, &format!("shardline/runs/{name}/"));
    for step in ["shard/checkpoint/.metadata", "reshard/checkpoint/.metadata", "export/hf/config.json"] {
        assert!(art.iter().any(|k| k.ends_with(step)), "no {step} in the artifact store: {art:?}");
    }
    assert_eq!(moto.open_multipart_uploads(ARTIFACTS), 0);
    // The export read the model's items of the resharded checkpoint, not its moments.
    let logs = hosts.rt.block_on(hosts.store.logs(LogFilter::Run(run), 0, 100_000)).expect("logs");
    let tasks = hosts.rt.block_on(hosts.store.run_tasks(run)).expect("tasks");
    let export_task = tasks.iter().find(|t| t.name == "export").map(|t| t.id).expect("export task");
    let read = logs
        .iter()
        .filter(|l| l.task == export_task)
        .find_map(|l| {
            let rest = l.line.strip_prefix("read ")?;
            let (fetched, rest) = rest.split_once(" of the ")?;
            Some((fetched.parse::<u64>().ok()?, rest.split_once(' ')?.0.parse::<u64>().ok()?))
        })
        .expect("the export's log says how much of the checkpoint it read");
    assert!(read.0 > 0 && read.0 * 2 < read.1, "the export read {} of {} bytes", read.0, read.1);
    // The reshard ran as a task per target rank file (tp2·dp2: four), each reading only the
    // source chunks its file is made from (items of a few KiB here, each fetched with its framing
    // and close ranges joined: less than the whole; the 2/world bound is `multihost::reshard`'s).
    let mut ranks: Vec<(String, u64, u64)> = Vec::new();
    for l in &logs {
        let Some(rest) = l.line.strip_prefix("rank ") else { continue };
        let Some((_, rest)) = rest.split_once(": read ") else { continue };
        let Some((fetched, rest)) = rest.split_once(" of the ") else { continue };
        let total = rest.split_once(' ').and_then(|(t, _)| t.parse::<u64>().ok()).expect("total");
        let worker = tasks.iter().find(|t| t.id == l.task).map(|t| t.name.clone()).expect("task");
        ranks.push((worker, fetched.parse().expect("fetched"), total));
    }
    ranks.sort();
    assert_eq!(ranks.len(), 4, "{ranks:?}");
    for (task, fetched, total) in &ranks {
        assert!(*fetched > 0 && fetched < total, "{task} read {fetched} of the source's {total} bytes");
    }
    eprintln!("reshard rank tasks read (task, bytes, of): {ranks:?}");
    // The tasks reading a checkpoint were claimed with the scratch it takes them: the reshard the
    // source and its output, the export the model's items and the release, validation parts
    // their files and the release ranges.
    let tasks = hosts.rt.block_on(hosts.store.run_tasks(run)).expect("tasks");
    let scratch = |name: &str| tasks.iter().find(|t| t.name == name).map(|t| t.resources.scratch);
    let sizes = |step: &str| moto.list_sizes(ARTIFACTS, &format!("shardline/runs/{name}/{step}/checkpoint/"));
    let (shard, resharded) = (sizes("shard"), sizes("reshard"));
    // Split by rank (tp2·dp2), the commit reads and writes `.metadata`, a rank task its share.
    let shard_metadata = shard.iter().find(|(k, _)| k.ends_with("/.metadata")).map(|(_, s)| *s).expect(".metadata");
    assert_eq!(scratch("reshard"), Some(3 * shard_metadata));
    assert_eq!(scratch("reshard/rank-0"), Some(shard_metadata + 4 * shard.values().sum::<u64>() / 4));
    let metadata = resharded.iter().find(|(k, _)| k.ends_with("/.metadata")).map(|(_, s)| *s).expect(".metadata");
    assert_eq!(scratch("export"), Some(metadata + 2 * read.0));
    let parts: Vec<_> = tasks.iter().filter(|t| t.name.starts_with("validate-resharded/part-")).collect();
    assert_eq!(parts.len(), 4, "one part per rank file of the resharded checkpoint");
    assert!(
        parts.iter().all(|t| t.resources.scratch > 2 * metadata),
        "{:?}",
        parts.iter().map(|t| t.resources.scratch).collect::<Vec<_>>()
    );

    let (ckpt, hf) = (out.join(&name).join("checkpoint"), out.join(&name).join("hf"));
    let o = run_validate(&ckpt);
    assert!(o.status.success(), "validate: {}{}", stdout(&o), stderr(&o));
    let (want, got) = (crate::release_tensors(&fixture("qwen3_moe")), crate::release_tensors(&hf));
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (tensor, w) in &want {
        assert!(&got[tensor] == w, "`{tensor}`: the exported tensor differs from the release's");
    }
}

/// `pipelines/torch-dist.yaml` with the artifact store as the only shared medium: the seed's
/// rank tasks upload `release/__R_0.distcp` of a Megatron-LM save directory and its commit
/// completes them, then writes the `_extra_state` objects, `.metadata`, `common.pt`,
/// `metadata.json` and the tracker last; validation is split by rank file of the checkpoint the
/// tracker names; the export, the translation to fsdp_dtensor and the one back to a torch_dist
/// save directory read and write the store. What was published validates bit-exact, and the
/// export is the release.
#[test]
fn a_torch_dist_pipeline_runs_on_the_artifact_store() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let moto = Moto::start(tmp.path());
    moto.create_bucket(ARTIFACTS);
    let hosts = Hosts::started(&moto, None, &["host-a", "host-b"]);
    let out = tmp.path().join("out");
    let spec = repo_root().join("pipelines/torch-dist.yaml");
    let run = hosts.submit(
        &spec,
        &[format!("model={}", fixture("qwen3_moe").display()), format!("dest=file://{}", out.display())],
    );
    let row = hosts.wait_run(run);
    assert_eq!(row.state, RunState::Succeeded, "{:?}", row.error);
    let name = row.options.name.clone().expect("run name");
    let keys = |step: &str| moto.list_keys(ARTIFACTS, &format!("shardline/runs/{name}/{step}/checkpoint/"));
    let names = |step: &str| -> BTreeSet<String> {
        keys(step).iter().filter_map(|k| k.split_once("/checkpoint/").map(|(_, n)| n.to_string())).collect()
    };
    let mut seed: BTreeSet<String> = (0..4).map(|r| format!("release/__{r}_0.distcp")).collect();
    seed.extend(
        ["latest_checkpointed_iteration.txt", "release/.metadata", "release/common.pt", "release/metadata.json"]
            .map(String::from),
    );
    let shard = names("shard");
    assert!(seed.is_subset(&shard), "the seed's save directory in the store: {shard:?}");
    assert!(shard.iter().any(|n| n.starts_with("release/") && n.ends_with("_1.distcp")), "{shard:?}");
    assert!(names("translate").contains(".metadata"), "{:?}", names("translate"));
    let back = names("back");
    assert!(back.contains("latest_checkpointed_iteration.txt"), "{back:?}");
    assert!(back.iter().any(|n| n.ends_with("/.metadata") && n.starts_with("release/")), "{back:?}");
    assert_eq!(moto.open_multipart_uploads(ARTIFACTS), 0);
    let tasks = hosts.rt.block_on(hosts.store.run_tasks(run)).expect("tasks");
    let parts = tasks.iter().filter(|t| t.name.starts_with("validate/part-")).count();
    assert_eq!(parts, 4, "one validation part per rank file of the seed");
    for step in ["validate", "validate-translated", "validate-back"] {
        let t = tasks.iter().find(|t| t.name == step).unwrap_or_else(|| panic!("no task {step}"));
        assert_eq!(t.output.as_ref().expect("output")["ok"], true, "{step}");
    }

    // What was published: the save directory validates bit-exact; the export is the release.
    let published = out.join(&name).join("megatron");
    assert!(published.join("latest_checkpointed_iteration.txt").is_file());
    let o = run_validate(&published);
    assert!(o.status.success(), "validate: {}{}", stdout(&o), stderr(&o));
    let (want, got) =
        (crate::release_tensors(&fixture("qwen3_moe")), crate::release_tensors(&out.join(&name).join("hf")));
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (tensor, w) in &want {
        assert!(&got[tensor] == w, "`{tensor}`: the exported tensor differs from the release's");
    }
}

fn run_validate(ckpt: &Path) -> std::process::Output {
    crate::run(bin().arg("validate").arg(ckpt).arg("--against").arg(fixture("qwen3_moe")).args(["--etp", "1"]))
}

/// Rank tasks whose worker needs little of each release file read just their byte ranges (a
/// worker reads a file whole when the ranks it can expect to run need half of it between them):
/// four workers, a synthetic Llama on dp8, where a rank's eighth of a tensor is separated from
/// the next tensor's by more than the gap ranges are merged across, with 3 MiB sections. Every
/// rank fetches a fraction of the release and writes its file in several sections, each fetched,
/// written, uploaded and freed in turn, and the checkpoint validates bit-exact against it.
#[test]
fn ranks_read_only_their_byte_ranges_when_their_worker_needs_little_of_a_file() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let release = tmp.path().join("release");
    let o = crate::run(bin().args(["synth", "--arch", "llama", "--size", "160MB"]).arg(&release));
    assert!(o.status.success(), "synth: {}", stderr(&o));
    let release_bytes: u64 = std::fs::read_dir(&release)
        .expect("release")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .map(|e| e.metadata().expect("size").len())
        .sum();
    let moto = Moto::start(tmp.path());
    moto.create_bucket(ARTIFACTS);
    let mut hosts = Hosts::new(&moto, None);
    hosts.spawn("server", &["server"]);
    for w in ["host-a", "host-b", "host-c", "host-d"] {
        // Small sections: each rank file is fetched, written and uploaded in several.
        let args = ["worker", "--name", w, "--cpus", "2", "--lease-seconds", "3", "--rank-section", "3MiB"];
        hosts.spawn(w, &args);
    }
    // The share a worker expects to read follows the active workers: wait for all four.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while hosts.rt.block_on(hosts.store.list_workers()).expect("workers").len() < 4 {
        assert!(std::time::Instant::now() < deadline, "four workers did not register");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let spec = tmp.path().join("ranged.yaml");
    let steps = format!(
        "apiVersion: shardline/v1\nkind: Pipeline\nname: ranged\nsteps:\n\
         \x20 - {{id: download, uses: hf.download, with: {{path: \"{}\"}}}}\n\
         \x20 - {{id: shard, uses: megatron.shard, needs: [download], with: {{tp: 1, dp: 8}}}}\n\
         \x20 - {{id: validate, uses: checkpoint.validate, needs: [shard]}}\n",
        release.display()
    );
    std::fs::write(&spec, steps).expect("spec");
    let run = hosts.submit(&spec, &[]);
    let row = hosts.wait_run(run);
    assert_eq!(row.state, RunState::Succeeded, "{:?}", row.error);
    let tasks = hosts.rt.block_on(hosts.store.run_tasks(run)).expect("tasks");
    let validate = tasks.iter().find(|t| t.name == "validate").expect("validate task");
    assert_eq!(validate.output.as_ref().expect("output")["ok"], true);

    let logs = hosts.rt.block_on(hosts.store.logs(LogFilter::Run(run), 0, 100_000)).expect("logs");
    let fetched: Vec<u64> =
        logs.iter().filter_map(|l| l.line.strip_prefix("fetched ")?.split_once(' ')?.0.parse().ok()).collect();
    assert_eq!(fetched.len(), 8, "one fetch per rank: {fetched:?}");
    let sections: Vec<u64> =
        logs.iter().filter_map(|l| l.line.split_once("; written in ")?.1.split_once(' ')?.0.parse().ok()).collect();
    assert!(sections.len() == 8 && sections.iter().all(|&n| n > 1), "sections per rank: {sections:?}");
    assert!(
        fetched.iter().all(|&n| n > 0 && n * 4 < release_bytes),
        "every rank read a fraction of the {release_bytes} release bytes: {fetched:?}"
    );
    // So did validation: eight parts, each with a rank file and the release ranges it is made of.
    let parts: Vec<(u64, u64)> = logs
        .iter()
        .filter_map(|l| {
            let (_, rest) = l.line.split_once("; fetched ")?;
            let (checkpoint, rest) = rest.split_once(" checkpoint bytes and ")?;
            Some((checkpoint.parse().ok()?, rest.split_once(' ')?.0.parse().ok()?))
        })
        .collect();
    assert_eq!(parts.len(), 8, "one validation part per rank file: {parts:?}");
    assert!(
        parts.iter().all(|&(c, r)| c > 0 && c * 4 < release_bytes && r > 0 && r * 4 < release_bytes),
        "every part read a fraction of the checkpoint and of the {release_bytes} release bytes: {parts:?}"
    );
    assert_eq!(moto.open_multipart_uploads(ARTIFACTS), 0);
}

/// Validation split by rank file, in both output formats: an intact checkpoint validates, two
/// parts and the task that sums them; a rank file changed in the store after its commit (one byte
/// flipped by a command step, as bit rot or a stray writer would) fails the part that reads that
/// file, naming it, while the other part passes, and the run fails without the validation task.
#[test]
fn a_rank_file_corrupted_in_the_store_fails_the_part_that_reads_it() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let moto = Moto::start(tmp.path());
    moto.create_bucket(ARTIFACTS);
    let hosts = Hosts::started(&moto, None, &["host-a", "host-b"]);
    // Flips a byte in the middle of the object whose key starts with argv[1] and ends with argv[2].
    let script = tmp.path().join("corrupt.py");
    std::fs::write(
        &script,
        "import sys, boto3\n\
         s3 = boto3.client('s3')\n\
         keys = [o['Key'] for o in s3.list_objects_v2(Bucket='artifacts', Prefix=sys.argv[1])['Contents']]\n\
         key = [k for k in keys if k.endswith(sys.argv[2])][0]\n\
         data = bytearray(s3.get_object(Bucket='artifacts', Key=key)['Body'].read())\n\
         data[len(data) // 2] ^= 0x55\n\
         s3.put_object(Bucket='artifacts', Key=key, Body=bytes(data))\n\
         print('corrupted', key)\n",
    )
    .expect("script");
    let python = repo_root().join(".venv/bin/python");
    let env: Vec<String> = moto.env().iter().map(|(k, v)| format!("{k}: \"{v}\"")).collect();
    for (format, second_file) in
        [("dcp", "__1_0.distcp"), ("dcp-safetensors", "shard-00002-model-00001-of-00001.safetensors")]
    {
        for corrupt in [false, true] {
            let name = format!("{format}-{}", if corrupt { "corrupted" } else { "intact" });
            let corrupt_step = format!(
                "\x20 - {{id: corrupt, uses: command, needs: [shard], retry: {{attempts: 1}}, timeout: 60s,\n\
                 \x20     with: {{run: [\"{}\", \"{}\", \"shardline/runs/{name}-\", \"/shard/checkpoint/{second_file}\"], env: {{{}}}}}}}\n",
                python.display(),
                script.display(),
                env.join(", ")
            );
            let spec = tmp.path().join(format!("{name}.yaml"));
            // `cache: false`: each run writes its own checkpoint (a cached one would be the
            // intact run's, which the corrupted run would then change).
            std::fs::write(
                &spec,
                format!(
                    "apiVersion: shardline/v1\nkind: Pipeline\nname: {name}\nsteps:\n\
                     \x20 - {{id: download, uses: hf.download, with: {{path: \"{}\"}}}}\n\
                     \x20 - {{id: shard, uses: megatron.shard, needs: [download], cache: false, with: {{tp: 1, dp: 2, format: {format}}}}}\n\
                     {}\
                     \x20 - {{id: validate, uses: checkpoint.validate, needs: [{}]}}\n",
                    fixture("llama").display(),
                    if corrupt { corrupt_step.as_str() } else { "" },
                    if corrupt { "corrupt" } else { "shard" },
                ),
            )
            .expect("spec");
            let run = hosts.submit(&spec, &[]);
            let row = hosts.wait_run(run);
            let tasks = hosts.rt.block_on(hosts.store.run_tasks(run)).expect("tasks");
            let task = |name: &str| tasks.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no task `{name}`"));
            if !corrupt {
                assert_eq!(task("validate/part-0").state, TaskState::Succeeded, "{name}: {:?}", row.error);
                assert_eq!(row.state, RunState::Succeeded, "{name}: {:?}", row.error);
                assert_eq!(task("validate/part-1").state, TaskState::Succeeded);
                assert_eq!(task("validate").output.as_ref().expect("output")["ok"], true, "{name}");
                continue;
            }
            assert_eq!(row.state, RunState::Failed, "{name}: {row:?}");
            assert_eq!(task("corrupt").state, TaskState::Succeeded, "{name}");
            // The intact file's part passes, unless the run's failure cancelled it first.
            assert_ne!(task("validate/part-0").state, TaskState::Failed, "{name}");
            let failed = task("validate/part-1");
            assert_eq!(failed.state, TaskState::Failed, "{name}");
            let error = failed.error.clone().unwrap_or_default();
            assert!(error.contains(second_file) && error.contains("differs from its source"), "{name}: {error}");
            assert_ne!(task("validate").state, TaskState::Succeeded, "{name}: no validation without its parts");
        }
    }
}

/// A run on the artifact store is served from the step cache: a second run of the same shard and
/// reshard steps writes no rank file and no resharded checkpoint, and validates the first run's
/// resharded checkpoint in the store. While it runs,
/// gc keeps the first run's prefix (it reads it), however old; once both are done it frees both,
/// and a third run, its cache entry gone with the prefix, converts again.
#[test]
fn a_run_on_the_artifact_store_is_served_from_the_step_cache_and_gc_keeps_what_it_reads() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let moto = Moto::start(tmp.path());
    moto.create_bucket(ARTIFACTS);
    let hosts = Hosts::started(&moto, None, &["host-a", "host-b"]);
    let spec = |name: &str, hold: bool| {
        let path = tmp.path().join(format!("{name}.yaml"));
        let hold_step = "\x20 - {id: hold, uses: command, needs: [reshard], with: {run: [sleep, \"6\"]}}\n";
        std::fs::write(
            &path,
            format!(
                "apiVersion: shardline/v1\nkind: Pipeline\nname: cached\nsteps:\n\
                 \x20 - {{id: download, uses: hf.download, with: {{path: \"{}\"}}}}\n\
                 \x20 - {{id: shard, uses: megatron.shard, needs: [download], with: {{tp: 1, dp: 2}}}}\n\
                 \x20 - {{id: split, uses: megatron.split_fused, needs: [shard]}}\n\
                 \x20 - {{id: reshard, uses: checkpoint.reshard, needs: [split], with: {{tp: 2, dp: 1, rng: drop}}}}\n\
                 {}\
                 \x20 - {{id: validate, uses: checkpoint.validate, needs: [{}]}}\n",
                fixture("llama").display(),
                if hold { hold_step } else { "" },
                if hold { "hold" } else { "reshard" }
            ),
        )
        .expect("spec");
        path
    };
    let succeeded = |run: RunId| {
        let row = hosts.wait_run(run);
        assert_eq!(row.state, RunState::Succeeded, "{:?}", row.error);
        let tasks = hosts.rt.block_on(hosts.store.run_tasks(run)).expect("tasks");
        let validate = tasks.iter().find(|t| t.name == "validate").expect("validate");
        assert_eq!(validate.output.as_ref().expect("output")["ok"], true);
        (row.options.name.clone().expect("run name"), tasks)
    };
    // Rank tasks and the reshard served from the cache.
    let cached_ranks = |tasks: &[shardline_store::TaskRow]| {
        tasks
            .iter()
            .filter(|t| t.name.contains("/rank-") || t.name == "reshard")
            .filter(|t| t.output.as_ref().is_some_and(|o| o["cached"] == true))
            .count()
    };
    let prefix = |name: &str| format!("shardline/runs/{name}/");
    let gc = || {
        let o = crate::run(&mut hosts.cmd("client", &["gc", "--json", "--retain-runs", "1s"]));
        assert!(o.status.success(), "gc: {}\n{}", stdout(&o), stderr(&o));
    };

    let (first, tasks) = succeeded(hosts.submit(&spec("first", false), &[]));
    assert_eq!(cached_ranks(&tasks), 0, "the first run converts");
    let second = hosts.submit(&spec("second", true), &[]);
    // While the second run holds, gc keeps the first run's checkpoint it reads.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let tasks = hosts.rt.block_on(hosts.store.run_tasks(second)).expect("tasks");
        if tasks.iter().any(|t| t.name == "hold" && t.state == TaskState::Leased) {
            break;
        }
        assert!(Instant::now() < deadline, "the second run never reached its hold: {tasks:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(1500));
    gc();
    assert!(
        moto.list_keys(ARTIFACTS, &prefix(&first)).iter().any(|k| k.ends_with("/shard/checkpoint/.metadata")),
        "gc freed the checkpoint a running run reads"
    );
    let (second_name, tasks) = succeeded(second);
    // The shard's two rank tasks, the reshard's two (tp2) and its commit.
    assert_eq!(cached_ranks(&tasks), 5, "the second run's ranks and reshard are served from the cache");
    assert!(
        !moto.list_keys(ARTIFACTS, &prefix(&second_name)).iter().any(|k| k.contains("/checkpoint/")),
        "the second run wrote no checkpoint of its own"
    );

    // Both done: gc frees both prefixes; the cache entry then serves no one.
    std::thread::sleep(Duration::from_millis(1500));
    gc();
    assert!(moto.list_keys(ARTIFACTS, &prefix(&first)).is_empty(), "the first run's prefix was freed");
    let (_, tasks) = succeeded(hosts.submit(&spec("third", false), &[]));
    assert_eq!(cached_ranks(&tasks), 0, "the third run converts again");
}
