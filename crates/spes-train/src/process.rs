//! What the kernel says of a process: resident memory and bytes written to storage, from
//! `/proc` (Linux; every reader gives 0 where the kernel does not say). Nodes and the server
//! report these in their metrics; the benchmarks read them of their child processes.

/// Resident set size now of process `pid` (`std::process::id()` for this one) in MiB.
pub fn rss_mb(pid: u32) -> f64 {
    status_mb(pid, "VmRSS:")
}

/// Peak resident set size of process `pid` in MiB.
pub fn peak_rss_mb(pid: u32) -> f64 {
    status_mb(pid, "VmHWM:")
}

/// A memory line (`VmRSS:`, `VmHWM:`) of `/proc/<pid>/status` in MiB.
fn status_mb(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// CPU seconds the calling thread has used so far (0 where the clock is missing): what a
/// paused process does not accumulate. (libtorch's CPU kernels run part of their work on the
/// calling thread, so a busy step shows here about as long as it took.)
pub fn thread_cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec for the call's duration.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } == 0;
    if ok {
        t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
    } else {
        0.0
    }
}

/// Bytes this process has caused to be written to storage so far (`write_bytes` of
/// `/proc/self/io`: what reaches the disk, not what stays in a pipe or socket).
pub fn bytes_written() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("write_bytes:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_cpu_time_counts_work_and_not_sleep() {
        let start = thread_cpu_seconds();
        std::thread::sleep(std::time::Duration::from_millis(200));
        let slept = thread_cpu_seconds() - start;
        assert!(
            slept < 0.02,
            "a 200 ms sleep used {slept} s of this thread's CPU"
        );
        // Work accrues CPU time (however busy the machine, within a generous bound).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut x = 0u64;
        while thread_cpu_seconds() - start < 0.1 {
            assert!(std::time::Instant::now() < deadline, "no CPU time accrued");
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }

    #[test]
    fn this_process_has_memory_and_its_writes_count() {
        let me = std::process::id();
        let (now, peak) = (rss_mb(me), peak_rss_mb(me));
        assert!(now > 1.0 && peak >= now, "rss {now} MiB, peak {peak} MiB");
        assert_eq!(rss_mb(u32::MAX), 0.0, "no such process");
        let before = bytes_written();
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("x");
        std::fs::write(&f, vec![1u8; 1 << 20]).unwrap();
        std::fs::File::open(&f).unwrap().sync_all().unwrap();
        // Containers without per-task I/O accounting say 0 throughout.
        let after = bytes_written();
        assert!(
            after == 0 || after >= before + (1 << 20),
            "{before} -> {after}"
        );
    }
}
