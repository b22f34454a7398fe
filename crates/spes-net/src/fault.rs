//! Crash points for the chaos test. `SPES_FAULT=upload@3,publish@4` makes this process SIGKILL
//! itself when it reaches `upload` of round 3 or `publish` of round 4. Only tests set it.
//!
//! Points: `train@S` (node, after optimizer step S), `upload@R` (node, after the first chunk of
//! its round-R upload is queued), `download@R` (node, after the header of round R arrived),
//! `publish@R` (server, after round R's file is written, before the restart point is),
//! `joined@R` (server, after a join in open round R changed the restart point and it is
//! durable, before the reply), `acked@R` (server, 50 ms after it acknowledged an upload of
//! round R).

use std::sync::OnceLock;

/// The environment variable naming the crash points.
pub const ENV: &str = "SPES_FAULT";

fn points() -> &'static [(String, u64)] {
    static POINTS: OnceLock<Vec<(String, u64)>> = OnceLock::new();
    POINTS.get_or_init(|| {
        std::env::var(ENV)
            .unwrap_or_default()
            .split(',')
            .filter_map(|p| {
                let (name, n) = p.trim().split_once('@')?;
                Some((name.to_owned(), n.parse().ok()?))
            })
            .collect()
    })
}

/// SIGKILLs this process if `name@n` is a configured crash point.
pub fn point(name: &str, n: u64) {
    if points().iter().any(|(p, m)| p == name && *m == n) {
        eprintln!("{ENV}: crashing at {name}@{n}");
        // Safety: plain syscalls on this process.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// [`point`] 50 ms from now, on a task of the current runtime: a point just after a reply left.
pub fn point_soon(name: &'static str, n: u64) {
    if points().iter().any(|(p, m)| p == name && *m == n) {
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            point(name, n);
        });
    }
}
