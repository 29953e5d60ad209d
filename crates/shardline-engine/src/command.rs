//! `command` tasks: a program run in a process group of its own, with a minimal environment,
//! the outputs of the steps it needs and the GPUs its lease was given; its stdout and stderr
//! streamed line by line into the task's log; stopped (SIGTERM to the group, SIGKILL after a
//! short grace) when the task is cancelled, its lease is lost or its timeout passes. The exit
//! code decides the outcome; the output directory and a `result.json` written there are the
//! task's recorded output.

use std::collections::{BTreeMap, VecDeque};
use std::fs;
use std::io::{BufRead, BufReader, ErrorKind, Read};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::process::{kill_process_group, test_kill_process_group, Pid, Signal};
use serde_json::Value;
use shardline_control::graph::{step_env_prefix, CommandJob};
use shardline_control::TaskOutput;

use crate::steps::{StepContext, StepError};

/// The file in the output directory whose JSON object becomes the task's `result`.
pub const RESULT_FILE: &str = "result.json";
/// The largest `result.json` recorded: results are small summaries, files go in the directory.
pub const MAX_RESULT_BYTES: u64 = 64 * 1024;
/// Between SIGTERM and SIGKILL: short, so that the group is gone within 2 s of the decision.
const GRACE: Duration = Duration::from_millis(800);
/// How often the child, the cancel flag and the deadline are looked at.
const POLL: Duration = Duration::from_millis(20);
/// Longer output lines are logged in pieces of this size.
const MAX_LINE: usize = 8 * 1024;
/// Lines of stderr quoted in the error of a failed command.
const STDERR_TAIL: usize = 10;
/// The worker's variables every command gets (when the worker has them): what programs expect
/// to find, nothing that carries credentials. Others are passed by name with `inherit`.
const BASE_ENV: &[&str] = &["PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR"];
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Runs the command to its end and reports its output.
pub fn run(job: &CommandJob, ctx: &StepContext) -> Result<TaskOutput, StepError> {
    let shown = shown(job);
    let env = environment(job, ctx)?;
    fresh_dir(&job.out)?;
    let mut cmd = match (job.shell, job.run.first()) {
        (true, Some(script)) => {
            let mut c = Command::new("/bin/sh");
            c.arg("-c").arg(script);
            c
        }
        (false, Some(program)) => {
            let mut c = Command::new(program);
            c.args(&job.run[1..]);
            c
        }
        (_, None) => return Err(StepError::fatal("the command is empty")),
    };
    cmd.env_clear()
        .envs(&env)
        .current_dir(&job.workdir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A group of its own: the command and everything it starts are signalled together.
        .process_group(0);
    let mut child =
        cmd.spawn().map_err(|e| StepError::fatal(format!("cannot start {shown} in {}: {e}", job.workdir.display())))?;
    let group = Pid::from_child(&child);
    (ctx.log)(format!(
        "started {shown} as process group {} (CUDA_VISIBLE_DEVICES={:?})",
        group.as_raw_nonzero(),
        env.get("CUDA_VISIBLE_DEVICES").map(String::as_str).unwrap_or_default()
    ));
    let tail = Arc::new(Mutex::new(VecDeque::new()));
    let (done_tx, done_rx) = mpsc::channel::<()>();
    std::thread::scope(|scope| {
        let (log, log_err) = (ctx.log, ctx.stderr);
        if let Some(out) = child.stdout.take() {
            let done = done_tx.clone();
            scope.spawn(move || {
                pump(out, log);
                let _ = done.send(());
            });
        }
        if let Some(err) = child.stderr.take() {
            let (done, tail) = (done_tx.clone(), tail.clone());
            scope.spawn(move || {
                pump(err, |line| {
                    if let Ok(mut t) = tail.lock() {
                        if t.len() == STDERR_TAIL {
                            t.pop_front();
                        }
                        t.push_back(line.clone());
                    }
                    log_err(line)
                });
                let _ = done.send(());
            });
        }
        drop(done_tx);
        let ended = supervise(&mut child, group, ctx);
        // Whatever the command left behind in its group goes with it.
        let _ = kill_process_group(group, Signal::KILL);
        // The pipes close once every process holding them is gone; one that left the group
        // (`setsid`) and keeps them open is not waited for.
        let deadline = Instant::now() + Duration::from_secs(2);
        for _ in 0..2 {
            if done_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_err() {
                (ctx.log)("a process outside the command's group still holds its output open".into());
                break;
            }
        }
        let tail: Vec<String> = tail.lock().map(|t| t.iter().cloned().collect()).unwrap_or_default();
        conclude(job, &shown, ended?, &tail, ctx)
    })
}

/// How the command ended.
enum Ended {
    Exited(ExitStatus),
    /// Stopped by the worker: cancelled, lease lost or timed out.
    Stopped {
        why: &'static str,
        status: ExitStatus,
    },
}

/// Waits for the command, stopping its group when the task is cancelled or its lease lost (the
/// worker sets `cancel`) or its timeout passes.
fn supervise(child: &mut Child, group: Pid, ctx: &StepContext) -> Result<Ended, StepError> {
    let started = Instant::now();
    let wait_err = |e: std::io::Error| StepError::transient(format!("waiting for the command: {e}"));
    loop {
        if let Some(status) = child.try_wait().map_err(wait_err)? {
            return Ok(Ended::Exited(status));
        }
        let why = if ctx.progress.cancel.load(Ordering::Relaxed) {
            Some("the task was cancelled or its lease lost")
        } else if !ctx.timeout.is_zero() && started.elapsed() > ctx.timeout {
            Some("the step's timeout passed")
        } else {
            None
        };
        if let Some(why) = why {
            (ctx.log)(format!("stopping the command: {why}; SIGTERM to its process group"));
            let _ = kill_process_group(group, Signal::TERM);
            let grace = Instant::now() + GRACE;
            let mut status = None;
            while Instant::now() < grace {
                if status.is_none() {
                    status = child.try_wait().map_err(wait_err)?;
                }
                if status.is_some() && test_kill_process_group(group).is_err() {
                    break;
                }
                std::thread::sleep(POLL);
            }
            if test_kill_process_group(group).is_ok() {
                (ctx.log)(format!("the command's group outlived {GRACE:?} after SIGTERM; SIGKILL"));
                let _ = kill_process_group(group, Signal::KILL);
            }
            let status = match status {
                Some(s) => s,
                None => child.wait().map_err(wait_err)?,
            };
            return Ok(Ended::Stopped { why, status });
        }
        std::thread::sleep(POLL);
    }
}

/// The task's outcome: success on exit code 0 (with the output directory and its result), a
/// failure naming the exit code or the signal, with the last lines of stderr, otherwise.
fn conclude(
    job: &CommandJob,
    shown: &str,
    ended: Ended,
    tail: &[String],
    ctx: &StepContext,
) -> Result<TaskOutput, StepError> {
    let stderr = if tail.is_empty() { String::new() } else { format!("; last lines of stderr:\n{}", tail.join("\n")) };
    let status = match ended {
        Ended::Stopped { why, status } => {
            return Err(StepError::transient(format!("{shown} was stopped ({why}): {}", describe(status))));
        }
        Ended::Exited(status) => status,
    };
    if !status.success() {
        // Another attempt may help (a flaky command); `retry.attempts` bounds them.
        return Err(StepError::transient(format!("{shown} {}{stderr}", describe(status))));
    }
    let result = read_result(&job.out)?;
    (ctx.log)(format!(
        "{shown} exited with code 0{}",
        if result.is_some() { format!("; recorded {RESULT_FILE}") } else { String::new() }
    ));
    Ok(TaskOutput { dir: Some(job.out.clone()), result, exit_code: Some(0), ..TaskOutput::default() })
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig} ({})", signal_name(sig)),
        (None, None) => format!("ended with {status}"),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        _ => "another signal",
    }
}

/// The command's `result.json`, when it wrote one: a JSON object of at most [`MAX_RESULT_BYTES`].
fn read_result(out: &Path) -> Result<Option<serde_json::Map<String, Value>>, StepError> {
    let path = out.join(RESULT_FILE);
    let meta = match fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StepError::transient(format!("{}: {e}", path.display()))),
    };
    if meta.len() > MAX_RESULT_BYTES {
        return Err(StepError::fatal(format!(
            "{} is {} bytes; a result is at most {MAX_RESULT_BYTES} bytes (write larger outputs as files beside it)",
            path.display(),
            meta.len()
        )));
    }
    let text = fs::read(&path).map_err(|e| StepError::transient(format!("{}: {e}", path.display())))?;
    match serde_json::from_slice::<Value>(&text) {
        Ok(Value::Object(m)) => Ok(Some(m)),
        Ok(other) => Err(StepError::fatal(format!(
            "{} holds {}, not a JSON object",
            path.display(),
            match other {
                Value::Array(_) => "an array",
                Value::String(_) => "a string",
                Value::Number(_) => "a number",
                Value::Bool(_) => "a boolean",
                _ => "null",
            }
        ))),
        Err(e) => Err(StepError::fatal(format!("{} is not valid JSON: {e}", path.display()))),
    }
}

/// The command's environment: a few of the worker's variables ([`BASE_ENV`] and `inherit`),
/// the spec's `env`, then what the worker sets — the output directory, the outputs of the steps
/// it needs, and the leased GPUs (empty when none, so the command cannot take any).
pub fn environment(job: &CommandJob, ctx: &StepContext) -> Result<BTreeMap<String, String>, StepError> {
    let mut env = BTreeMap::new();
    for name in BASE_ENV.iter().copied().chain(job.inherit.iter().map(String::as_str)) {
        if let Some(v) = std::env::var_os(name) {
            env.insert(name.to_string(), v.to_string_lossy().into_owned());
        }
    }
    env.entry("PATH".to_string()).or_insert_with(|| DEFAULT_PATH.to_string());
    env.extend(job.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.insert("SHARDLINE_OUTPUT_DIR".into(), job.out.display().to_string());
    for input in &job.inputs {
        let output = ctx
            .outputs
            .get(&input.task)
            .ok_or_else(|| StepError::transient(format!("output of task `{}` is not available", input.task)))?;
        let prefix = step_env_prefix(&input.step);
        let mut set = |suffix: &str, value: Option<String>| {
            if let Some(v) = value {
                env.insert(format!("{prefix}{suffix}"), v);
            }
        };
        set("DIR", output.dir.as_ref().map(|d| d.display().to_string()));
        set("PATH", output.path.as_ref().map(|p| p.display().to_string()));
        set("URL", output.dest.clone());
        set("RESULT", output.result.as_ref().map(|r| Value::Object(r.clone()).to_string()));
    }
    let gpus: Vec<String> = ctx.gpus.iter().map(u32::to_string).collect();
    env.insert("CUDA_VISIBLE_DEVICES".into(), gpus.join(","));
    Ok(env)
}

/// An empty output directory: what an earlier attempt left is removed first.
fn fresh_dir(dir: &Path) -> Result<(), StepError> {
    let io = |e: std::io::Error| StepError::transient(format!("{}: {e}", dir.display()));
    match fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    fs::create_dir_all(dir).map_err(io)
}

/// The command as its log and errors name it: `python3 check.py`, `sh -c 'script'`.
fn shown(job: &CommandJob) -> String {
    let text = if job.shell {
        format!("sh -c {:?}", job.run.first().map(String::as_str).unwrap_or_default())
    } else {
        job.run.join(" ")
    };
    let mut short: String = text.chars().take(120).collect();
    if short.len() < text.len() {
        short.push('…');
    }
    format!("`{short}`")
}

/// Hands each line of `r` to `emit` as it arrives (lossy UTF-8, without its newline; longer
/// lines in pieces of [`MAX_LINE`] bytes).
fn pump(r: impl Read, mut emit: impl FnMut(String)) {
    let mut r = BufReader::with_capacity(64 * 1024, r);
    let mut line: Vec<u8> = Vec::new();
    loop {
        let buf = match r.fill_buf() {
            Ok([]) => break,
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let room = MAX_LINE.saturating_sub(line.len()).max(1);
        let (take, complete) = match buf.iter().take(room).position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len().min(room), line.len() + buf.len().min(room) >= MAX_LINE),
        };
        line.extend_from_slice(&buf[..take]);
        r.consume(take);
        if complete {
            emit_line(&mut line, &mut emit);
        }
    }
    if !line.is_empty() {
        emit_line(&mut line, &mut emit);
    }
}

fn emit_line(line: &mut Vec<u8>, emit: &mut impl FnMut(String)) {
    if line.last() == Some(&b'\n') {
        line.pop();
    }
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    emit(String::from_utf8_lossy(line).into_owned());
    line.clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        pump(input, |l| out.push(l));
        out
    }

    #[test]
    fn output_is_split_into_bounded_lines() {
        assert_eq!(lines(b"a\nb\r\n\nlast"), ["a", "b", "", "last"]);
        let long = vec![b'x'; MAX_LINE * 2 + 5];
        let got = lines(&long);
        assert_eq!(got.iter().map(String::len).collect::<Vec<_>>(), [MAX_LINE, MAX_LINE, 5]);
        assert_eq!(lines(b"\xff\n"), ["\u{fffd}"]);
    }

    #[test]
    fn results_are_small_json_objects() {
        let dir = tempfile::tempdir().expect("temp dir");
        assert_eq!(read_result(dir.path()).expect("none"), None);
        fs::write(dir.path().join(RESULT_FILE), br#"{"ok": true}"#).expect("write");
        assert_eq!(read_result(dir.path()).expect("object").map(|m| m["ok"].clone()), Some(Value::Bool(true)));
        fs::write(dir.path().join(RESULT_FILE), b"[1]").expect("write");
        assert!(read_result(dir.path()).is_err_and(|e| e.message.contains("an array")));
        fs::write(dir.path().join(RESULT_FILE), vec![b' '; MAX_RESULT_BYTES as usize + 1]).expect("write");
        assert!(read_result(dir.path()).is_err_and(|e| e.message.contains("at most")));
    }
}
