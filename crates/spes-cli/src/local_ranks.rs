//! `spes train --local-ranks G`: starts G copies of this command as the ranks of one
//! data-parallel node (torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT) and supervises them: if one fails, the others are stopped and the command
//! fails naming it. Resuming (`--resume`) works with the same or another G. `--dist-backend`
//! picks the c10d backend the ranks use ([`DistBackend`]).

use anyhow::{bail, Context, Result};
use spes_train::data_parallel::{nccl, Backend};
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
                    bail!("rank {rank} failed ({status}); the other ranks were stopped. Its own error is above; if it died mid-run, rerun with --resume to continue from the last checkpoint");
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

/// `--dist-backend`: which c10d backend carries the ranks' collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DistBackend {
    /// NCCL when every rank on this machine has a GPU of its own and this spes has its NCCL
    /// part, else Gloo.
    Auto,
    Gloo,
    Nccl,
}

impl DistBackend {
    /// The backend for CUDA ranks, `local` of them on this machine's `gpus` GPUs.
    pub fn resolve(self, local: usize, gpus: usize) -> Result<Backend> {
        let own_gpu = local <= gpus;
        match self {
            DistBackend::Gloo => Ok(Backend::Gloo),
            DistBackend::Nccl if !own_gpu => bail!(
                "--dist-backend nccl: {local} ranks on this machine but {gpus} GPU(s); NCCL needs one GPU per rank (use gloo to share GPUs)"
            ),
            DistBackend::Nccl => {
                nccl::version().context("--dist-backend nccl")?;
                Ok(Backend::Nccl)
            }
            DistBackend::Auto if own_gpu => match nccl::version() {
                Ok(_) => Ok(Backend::Nccl),
                Err(e) => {
                    tracing::warn!("data parallel over Gloo: {e}");
                    Ok(Backend::Gloo)
                }
            },
            DistBackend::Auto => {
                tracing::warn!(
                    "{local} ranks share {gpus} GPU(s): data parallel over Gloo, through host memory"
                );
                Ok(Backend::Gloo)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::DistBackend;
    use spes_train::data_parallel::Backend;

    #[test]
    fn nccl_only_when_every_rank_has_its_own_gpu() {
        assert_eq!(DistBackend::Auto.resolve(2, 1).unwrap(), Backend::Gloo);
        assert_eq!(DistBackend::Gloo.resolve(2, 8).unwrap(), Backend::Gloo);
        let e = DistBackend::Nccl.resolve(4, 2).unwrap_err().to_string();
        assert!(e.contains("one GPU per rank"), "{e}");
        // This build carries the NCCL part (tested in spes-ext), so it is picked when it fits.
        assert_eq!(DistBackend::Auto.resolve(2, 2).unwrap(), Backend::Nccl);
        assert_eq!(DistBackend::Nccl.resolve(1, 1).unwrap(), Backend::Nccl);
    }

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
