//! Small reporting helpers shared by the commands.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use shardline_formats::execute::Progress;

/// Human-readable bytes (binary units).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// Peak resident set size of this process (`VmHWM`), in bytes.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A progress bar over a byte counter, drawn on stderr only when it is a terminal.
pub struct Bar {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Bar {
    /// A bar over an operation's [`Progress`], its length the total the operation sets once
    /// planned.
    pub fn follow(label: &str, progress: Arc<Progress>) -> Bar {
        let stop = Arc::new(AtomicBool::new(false));
        if !std::io::stderr().is_terminal() {
            return Bar { stop, handle: None };
        }
        let pb = ProgressBar::new(progress.bytes_total.load(Ordering::Relaxed));
        if let Ok(style) =
            ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}")
        {
            pb.set_style(style.progress_chars("=> "));
        }
        pb.set_message(label.to_string());
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                pb.set_length(progress.bytes_total.load(Ordering::Relaxed));
                pb.set_position(progress.bytes_written.load(Ordering::Relaxed));
                std::thread::sleep(Duration::from_millis(100));
            }
            pb.set_position(progress.bytes_written.load(Ordering::Relaxed));
            pb.finish_and_clear();
        });
        Bar { stop, handle: Some(handle) }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
