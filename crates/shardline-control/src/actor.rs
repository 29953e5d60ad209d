//! Who acts on a run, as the store records it (`runs.submitted_by`, `run_actions.actor`): one
//! spelling per kind of actor, defined here so that the API, the CLI and the trigger poller
//! agree.

use std::os::unix::fs::MetadataExt;

/// The HTTP API, on behalf of the token that authorized the request: `token:<name>`.
pub fn token(name: &str) -> String {
    format!("token:{name}")
}

/// A trigger's firing: `trigger:<pipeline>#<position in the spec's triggers:>`.
pub fn trigger(pipeline: &str, position: u32) -> String {
    format!("trigger:{pipeline}#{position}")
}

/// The local CLI: `user:<login>@<host>`, the login from `USER` or `LOGNAME` (else `uid<n>`),
/// the host from the kernel (else `localhost`).
pub fn local_user() -> String {
    let env = |k: &str| std::env::var(k).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    let login = env("USER").or_else(|| env("LOGNAME")).unwrap_or_else(|| {
        // The owner of our own /proc entry is our uid, without unsafe code.
        std::fs::metadata("/proc/self").map(|m| format!("uid{}", m.uid())).unwrap_or_else(|_| "unknown".into())
    });
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| env("HOSTNAME"))
        .unwrap_or_else(|| "localhost".into());
    format!("user:{login}@{host}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn spellings() {
        assert_eq!(super::token("ci"), "token:ci");
        assert_eq!(super::trigger("nightly", 2), "trigger:nightly#2");
        let me = super::local_user();
        assert!(me.starts_with("user:") && me.contains('@'), "{me}");
    }
}
