//! Data parallelism inside one node (several GPUs, or CPU processes): every rank holds the
//! same model, trains on its own rows of each batch, and gradients are averaged with c10d
//! (spes-ext's process group) before the optimizer step, so ranks stay bit-identical.
//!
//! Ranks meet as torchrun's do: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK for
//! the device) in the environment; `spes train --local-ranks G` sets them for G processes.

use anyhow::{bail, Context, Result};
use spes_ext::dist::{ProcessGroup, Rendezvous};
use std::time::Duration;
use tch::{Kind, Tensor};

/// This process's place in its node's data-parallel group.
pub struct DataParallel {
    group: ProcessGroup,
}

/// The torchrun-style environment of a rank, if this process is one of several.
pub fn rendezvous_from_env(timeout: Duration) -> Result<Option<Rendezvous>> {
    let var = |name: &str| std::env::var(name).ok();
    let world: usize = match var("WORLD_SIZE") {
        None => return Ok(None),
        Some(w) => w
            .parse()
            .with_context(|| format!("WORLD_SIZE={w:?}: expected a whole number"))?,
    };
    if world <= 1 {
        return Ok(None);
    }
    let rank: usize = var("RANK")
        .context("WORLD_SIZE is set but RANK is not")?
        .parse()
        .context("RANK: expected a whole number")?;
    let port: u16 = var("MASTER_PORT")
        .context("WORLD_SIZE is set but MASTER_PORT is not")?
        .parse()
        .context("MASTER_PORT: expected a port number")?;
    if rank >= world {
        bail!("RANK={rank} is not below WORLD_SIZE={world}");
    }
    Ok(Some(Rendezvous {
        host: var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
        port,
        rank,
        world,
        timeout,
    }))
}

impl DataParallel {
    /// Joins the group; returns once every rank has.
    pub fn join(r: &Rendezvous) -> Result<Self> {
        let group = ProcessGroup::join(r).with_context(|| {
            format!(
                "rank {} of {}: cannot join the group at {}:{}",
                r.rank, r.world, r.host, r.port
            )
        })?;
        Ok(DataParallel { group })
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    pub fn world(&self) -> usize {
        self.group.world()
    }

    /// Whether this rank writes the node's files (metrics, checkpoints).
    pub fn is_first(&self) -> bool {
        self.rank() == 0
    }

    /// Makes every rank's tensors rank 0's (after start-up or a load).
    pub fn broadcast_from_first(&self, ts: &[Tensor]) -> Result<()> {
        tch::no_grad(|| self.group.broadcast(ts, 0))
            .with_context(|| format!("rank {}: broadcast", self.rank()))
    }

    /// Replaces each tensor by its mean over the ranks.
    pub fn average(&self, ts: &[Tensor]) -> Result<()> {
        tch::no_grad(|| self.group.all_reduce_mean(ts))
            .with_context(|| format!("rank {}: all-reduce", self.rank()))
    }

    /// Averages the gradients of `params` over the ranks. A tensor that got no gradient on
    /// this rank (say, an expert no local token reached) first gets a zero one, so every rank
    /// reduces the same list.
    pub fn average_gradients(&self, params: &[Tensor]) -> Result<()> {
        let missing: Vec<&Tensor> = params.iter().filter(|p| !p.grad().defined()).collect();
        if !missing.is_empty() {
            let zero: Tensor = missing.iter().map(|p| (*p * 0.0).sum(Kind::Float)).sum();
            zero.backward();
        }
        let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
        self.average(&grads)
    }

    /// Fails unless every rank's `params` equal rank 0's bit for bit (compared through a
    /// checksum of each tensor's bits), naming the first tensor that differs.
    pub fn check_in_sync(&self, names: &[&str], params: &[Tensor]) -> Result<()> {
        let mine = tch::no_grad(|| {
            let sums: Vec<Tensor> = params.iter().map(bit_checksum).collect();
            Tensor::stack(&sums, 0)
        });
        let first = mine.copy();
        self.broadcast_from_first(std::slice::from_ref(&first))?;
        let (a, b) = (
            Vec::<i64>::try_from(&mine.to_device(tch::Device::Cpu))?,
            Vec::<i64>::try_from(&first.to_device(tch::Device::Cpu))?,
        );
        if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
            bail!(
                "rank {} has drifted from rank 0: tensor {} differs",
                self.rank(),
                names[i]
            );
        }
        Ok(())
    }
}

/// A checksum of a tensor's bits: any single changed element changes it.
fn bit_checksum(t: &Tensor) -> Tensor {
    let bits = match t.kind() {
        Kind::Float => t.view_dtype(Kind::Int),
        Kind::Double => t.view_dtype(Kind::Int64),
        Kind::BFloat16 | Kind::Half => t.view_dtype(Kind::Int16),
        _ => t.shallow_clone(),
    };
    let weights = Tensor::arange(bits.numel() as i64, (Kind::Int64, t.device())).fmod(7919) + 1;
    (bits.reshape([-1]).to_kind(Kind::Int64) * weights).sum(Kind::Int64)
}
