//! The fault soak: for two minutes a worker is killed with SIGKILL every one to three seconds
//! (and started again), the server is killed and restarted, PostgreSQL is restarted, while twelve
//! runs are submitted; every run succeeds, and the lost leases drew on their own budget.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use shardline_store::{AttemptKind, AttemptOutcome, RunId, RunState};

use crate::orchestrator::{restart_postgres, spec, synth, Deployment};

const SOAK: Duration = Duration::from_secs(120);
const RUNS: usize = 12;
const WORKERS: [&str; 3] = ["w1", "w2", "w3"];
/// Leases short enough that a killed worker's task is back in the queue within seconds.
const WORKER_ARGS: [&str; 4] = ["--cpus", "1", "--lease-seconds", "3"];

/// A small deterministic generator (xorshift), seeded from the clock and printed, so a failing
/// schedule of kills can be replayed by reading the log.
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo + 1))
    }
}

#[test]
fn runs_survive_workers_killed_every_few_seconds_and_a_server_and_postgres_restart() {
    let source = synth("qwen3_moe", "200MB");
    // Exclusive: PostgreSQL restarts under this test and no other may see it.
    let mut d = Deployment::new(true);
    d.server("server");
    for w in WORKERS {
        d.worker(w, &WORKER_ARGS);
    }
    let seed = SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |t| t.as_nanos() as u64) | 1;
    eprintln!("soak: kill schedule seed {seed}");
    let mut dice = Dice(seed);

    // Twelve runs, one every tenth of the soak, each on another mesh so the step cache cannot
    // serve one run's work to another.
    let meshes: Vec<(u64, u64)> = (1..=6).map(|dp| (1, dp + 1)).chain((1..=6).map(|dp| (2, dp))).collect();
    let mut runs: Vec<RunId> = Vec::new();
    let started = Instant::now();
    let mut next_kill = started + dice.millis(1000, 3000);
    let mut server_restarted = false;
    let mut postgres_restarted = false;
    let mut kills = 0;
    while started.elapsed() < SOAK {
        let due = runs.len() * SOAK.as_millis() as usize / RUNS;
        if runs.len() < RUNS && started.elapsed().as_millis() as usize >= due {
            let (tp, dp) = meshes[runs.len()];
            runs.push(d.submit(&spec(&format!("soak-{}", runs.len()), &source, tp, dp, "")));
        }
        if Instant::now() >= next_kill {
            let victim = WORKERS[(dice.next() % WORKERS.len() as u64) as usize];
            d.kill9_and_forget(victim);
            d.worker(victim, &WORKER_ARGS);
            kills += 1;
            next_kill = Instant::now() + dice.millis(1000, 3000);
        }
        if !server_restarted && started.elapsed() >= SOAK / 3 {
            d.kill9_and_forget("server");
            std::thread::sleep(Duration::from_secs(2));
            d.server("server");
            server_restarted = true;
        }
        if !postgres_restarted && started.elapsed() >= SOAK * 2 / 3 {
            restart_postgres();
            postgres_restarted = true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(runs.len(), RUNS);
    eprintln!("soak: {kills} workers killed in {:?}", started.elapsed());
    assert!(kills >= 40, "only {kills} kills in two minutes");

    let mut lost = 0;
    for (i, &run) in runs.iter().enumerate() {
        let r = d.wait_run(run);
        assert_eq!(r.state, RunState::Succeeded, "run {i} ({run}): {:?}", r.error);
        let tasks = d.q(|s| async move { s.run_tasks(run).await });
        for t in tasks {
            let attempts = d.q(|s| async move { s.task_attempts(t.id).await });
            for a in &attempts {
                if a.outcome == Some(AttemptOutcome::Expired) {
                    assert_eq!(a.kind, Some(AttemptKind::Lost), "{a:?}");
                    lost += 1;
                }
            }
            assert_eq!(attempts.last().and_then(|a| a.outcome), Some(AttemptOutcome::Succeeded), "{}", t.name);
        }
        let out = d.task(run, "validate").output.expect("validate output");
        assert_eq!(out["ok"], true, "run {i} did not validate: {out}");
    }
    eprintln!("soak: {lost} leases lost and retried");
    assert!(lost > 0, "no kill hit a running task: the soak tested nothing");
    for w in WORKERS.iter().chain(&["server"]) {
        assert!(d.alive(w), "`{w}` is not running at the end:\n{}", d.log(w));
    }
}
