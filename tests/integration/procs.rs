//! `shardline server` and `worker` processes on a test's embedded store (a state directory of
//! its own), killed when dropped, their output shown when the test fails.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::bin;

/// The longest a process may take to come up.
const WAIT: Duration = Duration::from_secs(90);

pub struct Process {
    child: Child,
    log: PathBuf,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- {} ----\n{}", self.log.display(), std::fs::read_to_string(&self.log).unwrap_or_default());
        }
    }
}

impl Process {
    /// The address a server printed once it listens.
    pub fn wait_for_address(&self) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            if let Some(addr) = log
                .lines()
                .find_map(|l| l.strip_prefix("server: dashboard and API on http://"))
                .and_then(|rest| rest.split('/').next())
            {
                return addr.to_string();
            }
            assert!(Instant::now() < deadline, "the server did not start:\n{log}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// `shardline ARGS` on the embedded store under `dir/state`, run from `dir`.
pub fn cmd(dir: &Path, args: &[&str]) -> Command {
    let mut c = bin();
    c.args(args).arg("--state-dir").arg(dir.join("state")).current_dir(dir).env_remove("SHARDLINE_DATABASE_URL");
    c
}

/// Starts `shardline ARGS` as [`cmd`] does, its output in `dir/NAME.log`.
pub fn spawn(dir: &Path, name: &str, args: &[&str]) -> Process {
    let log = dir.join(format!("{name}.log"));
    let out = File::create(&log).expect("log file");
    let child = cmd(dir, args)
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log file"))
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
    Process { child, log }
}
