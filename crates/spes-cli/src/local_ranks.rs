//! `spes train --local-ranks G`: starts G copies of this command as the ranks of one
//! data-parallel node (torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT) and supervises them: if one fails, the others are stopped and the command
//! fails naming it. Resuming (`--resume`) works with the same or another G.

use anyhow::{bail, Context, Result};
use std::process::{Child, Command};
use std::time::Duration;

/// Runs this process's own command line (without `--local-ranks`) as `ranks` processes.
pub fn launch(ranks: usize) -> Result<()> {
    if std::env::var_os("WORLD_SIZE").is_some() {
        bail!("--local-ranks: WORLD_SIZE is already set (a launcher started this process); drop one of the two");
    }
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let args = without_local_ranks(std::env::args().skip(1));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("cannot find a free port for the ranks' rendezvous")?
        .port();
    let mut children: Vec<Child> = Vec::with_capacity(ranks);
    for rank in 0..ranks {
        let child = Command::new(&exe)
            .args(&args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", ranks.to_string())
            .env("LOCAL_WORLD_SIZE", ranks.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .spawn()
            .with_context(|| format!("cannot start rank {rank}"));
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                stop(&mut children);
                return Err(e);
            }
        }
    }
    supervise(children)
}

/// Waits for every rank; the first failure stops the rest.
fn supervise(mut children: Vec<Child>) -> Result<()> {
    let mut done = vec![false; children.len()];
    while done.iter().any(|d| !d) {
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            if let Some(status) = child.try_wait()? {
                done[rank] = true;
                if !status.success() {
                    stop(&mut children);
                    bail!("rank {rank} failed ({status}); the other ranks were stopped. Rerun with --resume to continue from the last checkpoint");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

fn stop(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
    }
    for c in children.iter_mut() {
        let _ = c.wait();
    }
}

/// The arguments minus `--local-ranks N` / `--local-ranks=N`.
fn without_local_ranks(args: impl Iterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip_value = false;
    for a in args {
        if skip_value {
            skip_value = false;
        } else if a == "--local-ranks" {
            skip_value = true;
        } else if !a.starts_with("--local-ranks=") {
            out.push(a);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn drops_only_the_local_ranks_flag() {
        let args = [
            "train",
            "--local-ranks",
            "2",
            "--out",
            "x",
            "--local-ranks=3",
            "--resume",
        ];
        let kept = super::without_local_ranks(args.iter().map(|s| s.to_string()));
        assert_eq!(kept, ["train", "--out", "x", "--resume"]);
    }
}
