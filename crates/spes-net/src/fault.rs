//! Crash points for the chaos test. `SPES_FAULT=upload@3,publish@4` makes this process SIGKILL
//! itself when it reaches `upload` of round 3 or `publish` of round 4. Only tests set it.
//!
//! Points: `train@S` (node, after optimizer step S), `upload@R` (node, after the first chunk of
//! its round-R upload is queued), `download@R` (node, after the header of round R arrived),
//! `publish@R` (server, after round R's file is written, before the restart point is),
//! `joined@R` (server, after a join in open round R changed the restart point and it is
//! durable, before the reply), `acked@R` (server, 50 ms after it acknowledged an upload of
//! round R). Not crashes: `store-wait@R` (node, waits 3 s between getting round R's URL and
//! reading it), `corrupt-store@R` (server, puts round R's delta in the store with one byte
//! changed, the local file intact), `drop-staged@R` (server, deletes each upload of round R
//! its node staged in the store before reading it).

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

/// Whether `name@n` is a configured point.
pub fn active(name: &str, n: u64) -> bool {
    points().iter().any(|(p, m)| p == name && *m == n)
}

/// Sleeps `pause` the first time this process reaches `name@n`, if it is a configured point
/// (a slow moment, not a crash).
pub fn pause(name: &str, n: u64, pause: std::time::Duration) {
    static PAUSED: std::sync::Mutex<Vec<(String, u64)>> = std::sync::Mutex::new(Vec::new());
    if !active(name, n) {
        return;
    }
    let first = {
        let mut paused = PAUSED.lock().unwrap();
        let key = (name.to_owned(), n);
        !paused.contains(&key) && {
            paused.push(key);
            true
        }
    };
    if first {
        eprintln!("{ENV}: pausing {:.0} s at {name}@{n}", pause.as_secs_f64());
        std::thread::sleep(pause);
    }
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
