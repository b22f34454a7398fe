//! `spes bench soak`: does anything grow with a run's length? One server and 4 node processes
//! train a micro model one step a round for `--rounds` rounds, while this process samples them
//! every `--every` rounds: resident memory of the server and of the largest node, disk used by
//! each role, the size of every file that grows (metrics, the restart point, logs) and the
//! rounds' latency. Prints one row per sample.

use anyhow::{bail, Context, Result};
use spes_train::metrics::{self, RoundRecord};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, default_value_t = 1000)]
    rounds: u64,
    /// Sample every this many rounds.
    #[arg(long, default_value_t = 100)]
    every: u64,
    #[arg(long, default_value = "runs/bench-soak")]
    out: PathBuf,
}

const NODES: usize = 4;

fn soak_config(data: &Path, rounds: u64) -> String {
    format!(
        r#"
[model]
preset = "micro"
vocab_size = 8192

[data]
path = "{}"

[train]
max_steps = {rounds}
batch_size = 2
seq_len = 32
warmup_steps = 10
log_every = 10
eval_batches = 1

[sync]
mode = "spes"
nodes = {NODES}
sync_steps = 1
wire = "int4_delta"
merge_every = 50
merge_until = 200
round_timeout_s = 120
"#,
        data.display()
    )
}

/// Bytes under `path` (files only).
fn du(path: &Path) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if meta.is_file() {
        return meta.len();
    }
    std::fs::read_dir(path)
        .map(|d| d.flatten().map(|e| du(&e.path())).sum())
        .unwrap_or(0)
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

pub fn run(a: Args) -> Result<()> {
    if a.every == 0 || a.rounds < a.every {
        bail!("--every must be in 1..=--rounds");
    }
    let _ = std::fs::remove_dir_all(a.out.join("run"));
    let out = a.out.join("run");
    std::fs::create_dir_all(out.join("logs"))?;
    let data = crate::demo::prepare_data(&a.out)?;
    let config = out.join("config.toml");
    std::fs::write(&config, soak_config(&data, a.rounds))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let exe = std::env::current_exe()?;
    let spawn = |role: &str, args: &[String], log: &str| -> Result<Child> {
        Command::new(&exe)
            .arg(role)
            .arg("--config")
            .arg(&config)
            .args(["--device", "cpu", "--threads", "1"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(out.join("logs").join(log))?)
            .spawn()
            .with_context(|| format!("cannot start {role}"))
    };
    let server_out = out.join("server");
    let mut children = vec![spawn(
        "server",
        &[
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--no-auth".into(),
            "--out".into(),
            server_out.display().to_string(),
        ],
        "server.log",
    )?];
    for p in 0..NODES {
        children.push(spawn(
            "node",
            &[
                "--server".into(),
                format!("http://127.0.0.1:{port}"),
                "--peer".into(),
                p.to_string(),
                "--out".into(),
                out.join(format!("node-{p}")).display().to_string(),
                "--progress".into(),
                "quiet".into(),
            ],
            &format!("node-{p}.log"),
        )?);
    }
    let mut guard = Children(children);
    println!("\nserver + {NODES} nodes, micro model, int4 deltas, 1 step a round, {} rounds; sampled every {} rounds:\n", a.rounds, a.every);
    println!("| round | server RSS | largest node RSS | server disk | node-0 disk | server metrics | server.json | node-0 metrics | logs | round s (mean of the last {}) |", a.every);
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let started = Instant::now();
    let mut next = a.every;
    while next <= a.rounds {
        let rounds: Vec<RoundRecord> = metrics::read(&server_out.join("metrics.jsonl"));
        let newest = rounds.last().map_or(0, |r| r.round);
        if newest >= next {
            let recent: Vec<f64> = rounds
                .iter()
                .filter(|r| r.round + a.every > newest)
                .filter_map(|r| r.close.as_ref().map(|c| c.round_s))
                .collect();
            let rss = |c: &Child| spes_train::process::rss_mb(c.id());
            let largest = guard.0[1..].iter().map(rss).fold(0.0, f64::max);
            println!(
                "| {newest} | {:.0} MiB | {largest:.0} MiB | {:.1} MiB | {:.1} MiB | {:.2} MiB | {:.1} KiB | {:.2} MiB | {:.2} MiB | {:.3} |",
                rss(&guard.0[0]),
                mib(du(&server_out)),
                mib(du(&out.join("node-0"))),
                mib(size(&server_out.join("metrics.jsonl"))),
                size(&server_out.join("server.json")) as f64 / 1024.0,
                mib(size(&out.join("node-0/metrics.jsonl"))),
                mib(du(&out.join("logs"))),
                recent.iter().sum::<f64>() / recent.len().max(1) as f64,
            );
            next += a.every;
            continue;
        }
        let failed = guard
            .0
            .iter_mut()
            .position(|c| matches!(c.try_wait(), Ok(Some(s)) if !s.success()));
        if let Some(i) = failed {
            bail!(
                "process {i} of the soak failed; see {}",
                out.join("logs").display()
            );
        }
        if started.elapsed() > Duration::from_secs(4 * 3600) {
            bail!("the soak did not finish within 4 h");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    drop(guard);
    Ok(())
}

/// The run's processes, stopped when the bench ends.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
