//! Data parallelism inside one node (several GPUs, or CPU processes): every rank holds the
//! same model, trains on its own rows of each batch, and gradients are averaged with c10d
//! (spes-ext's process group) before the optimizer step, so ranks stay bit-identical.
//!
//! The AdamW state is sharded (ZeRO-1 with ZeRO-2's reduce-scatter): each trainable tensor
//! has one owner rank, to which its gradient is reduced, that keeps its moments and updates
//! it, then broadcasts the new values; a checkpoint gathers the
//! moments to rank 0, which writes them all, so a run resumes with any number of ranks.
//!
//! Ranks meet as torchrun's do: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK for
//! the device) in the environment; `spes train --local-ranks G` sets them for G processes.

use crate::optim::{AdamW, Moments, Retarget};
use anyhow::{bail, Context, Result};
pub use spes_ext::dist::{Backend, Rendezvous};
use spes_ext::dist::{PendingMean, ProcessGroup};
pub use spes_ext::nccl;
use spes_model::{MoeModel, Param, Stage};
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// This process's place in its node's data-parallel group.
pub struct DataParallel {
    group: ProcessGroup,
    /// Every trainable tensor (sharing storage with the model), by name.
    names: Vec<String>,
    trained: Vec<Tensor>,
    /// For each, the rank that holds its AdamW moments and updates it.
    owner: Vec<usize>,
    /// The names of this rank's own tensors.
    mine: HashSet<String>,
    /// For each, the stage of the staged backward that completes its gradient.
    stage: Vec<Stage>,
    /// Where this rank's tensors live (small control messages go there too).
    device: Device,
}

/// Owner rank of each of tensors of these sizes: largest first to the least-loaded rank (the
/// lowest on ties), so every rank computes the same, nearly even split.
pub fn partition(sizes: &[i64], world: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(sizes[i]));
    let mut load = vec![0i64; world];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let r = (0..world)
            .min_by_key(|&r| (load[r], r))
            .expect("world >= 1");
        owner[i] = r;
        load[r] += sizes[i];
    }
    owner
}

/// The torchrun-style environment of a rank, if this process is one of several (or, with
/// `single`, the only rank of a group that WORLD_SIZE=1 asks for, to exercise a backend); Gloo
/// until the caller, which knows the device, picks the backend.
pub fn rendezvous_from_env(timeout: Duration, single: bool) -> Result<Option<Rendezvous>> {
    let var = |name: &str| std::env::var(name).ok();
    let world: usize = match var("WORLD_SIZE") {
        None => return Ok(None),
        Some(w) => w
            .parse()
            .with_context(|| format!("WORLD_SIZE={w:?}: expected a whole number"))?,
    };
    if world == 0 || world == 1 && !single {
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
        backend: Backend::Gloo,
    }))
}

impl DataParallel {
    /// Joins the group, for tensors on `device`; returns once every rank has.
    pub fn join(r: &Rendezvous, device: Device) -> Result<Self> {
        let group = ProcessGroup::join(r).with_context(|| {
            format!(
                "rank {} of {}: cannot join the group at {}:{}",
                r.rank, r.world, r.host, r.port
            )
        })?;
        Ok(DataParallel {
            group,
            names: Vec::new(),
            trained: Vec::new(),
            owner: Vec::new(),
            mine: HashSet::new(),
            stage: Vec::new(),
            device,
        })
    }

    /// Splits the trainable tensors among the ranks and returns this rank's share, the
    /// tensors its optimizer should hold.
    pub fn shard(&mut self, trainable: Vec<Param>) -> Vec<Param> {
        let sizes: Vec<i64> = trainable.iter().map(|p| p.tensor.numel() as i64).collect();
        self.owner = partition(&sizes, self.world());
        self.names = trainable.iter().map(|p| p.name.clone()).collect();
        self.stage = self.names.iter().map(|n| MoeModel::stage_of(n)).collect();
        self.trained = trainable.iter().map(|p| p.tensor.shallow_clone()).collect();
        let me = self.rank();
        let share: Vec<Param> = trainable
            .into_iter()
            .zip(&self.owner)
            .filter(|(_, &o)| o == me)
            .map(|(p, _)| p)
            .collect();
        self.mine = share.iter().map(|p| p.name.clone()).collect();
        share
    }

    /// Whether this rank owns the trainable tensor `name` (holds its moments, updates it).
    pub fn owns(&self, name: &str) -> bool {
        self.mine.contains(name)
    }

    /// Trains `trainable` from now on (a node's experts changed): splits them among the ranks
    /// again and moves the moments of every kept tensor whose owner changed to its new owner,
    /// so no tensor restarts its moments because of the split. Every rank must call it with
    /// the same list; `opt` ends holding this rank's new share. Returns what changed for the
    /// node as a whole.
    pub fn reshard(&mut self, opt: &mut AdamW, trainable: Vec<Param>) -> Result<Retarget> {
        let before: HashMap<String, usize> = self
            .names
            .drain(..)
            .zip(self.owner.iter().copied())
            .collect();
        let share = self.shard(trainable);
        let mut report = Retarget::default();
        let now: HashSet<&str> = self.names.iter().map(String::as_str).collect();
        report.dropped = before
            .keys()
            .filter(|n| !now.contains(n.as_str()))
            .cloned()
            .collect();
        report.dropped.sort();
        let me = self.rank();
        let mut incoming = HashMap::new();
        for from in 0..self.world() {
            let moving: Vec<usize> = (0..self.names.len())
                .filter(|&i| before.get(&self.names[i]) == Some(&from) && self.owner[i] != from)
                .collect();
            for chunk in moving.chunks(64) {
                // Per tensor its two moments and its noise average (zeros where it has none),
                // then each one's start step and whether it has a noise average.
                let mut ts = Vec::with_capacity(3 * chunk.len() + 1);
                let (mut started, mut noisy) = (Vec::new(), Vec::new());
                for &i in chunk {
                    let held = (me == from)
                        .then(|| opt.moments_of(&self.names[i]))
                        .flatten();
                    let zeros = || self.trained[i].zeros_like();
                    match held {
                        Some(m) => {
                            noisy.push(m.noise.is_some() as i64);
                            ts.extend([m.exp_avg, m.exp_avg_sq, m.noise.unwrap_or_else(zeros)]);
                            started.push(m.started);
                        }
                        None => {
                            ts.extend([zeros(), zeros(), zeros()]);
                            started.push(0);
                            noisy.push(0);
                        }
                    }
                }
                started.extend(noisy);
                ts.push(Tensor::from_slice(&started).to_device(self.device));
                tch::no_grad(|| self.group.broadcast(&ts, from)).with_context(|| {
                    format!("rank {me}: moving moments from rank {from} to their new owners")
                })?;
                let flags =
                    Vec::<i64>::try_from(&ts.pop().expect("started").to_device(Device::Cpu))?;
                let (started, noisy) = flags.split_at(chunk.len());
                let mut ts = ts.into_iter();
                for (k, &i) in chunk.iter().enumerate() {
                    let (m, v, n) = (
                        ts.next().expect("exp_avg"),
                        ts.next().expect("exp_avg_sq"),
                        ts.next().expect("noise"),
                    );
                    if self.owner[i] == me {
                        let moments = Moments {
                            exp_avg: m.detach(),
                            exp_avg_sq: v.detach(),
                            started: started[k],
                            noise: (noisy[k] != 0).then(|| n.detach()),
                        };
                        incoming.insert(self.names[i].clone(), moments);
                    }
                }
            }
        }
        opt.retarget_with(share, incoming);
        for n in &self.names {
            if before.contains_key(n) {
                report.kept += 1;
            } else {
                report.fresh.push(n.clone());
            }
        }
        Ok(report)
    }

    /// Rank 0's `values` on every rank (a control message; what the others pass is ignored).
    pub fn broadcast_ints(&self, values: Vec<i64>) -> Result<Vec<i64>> {
        let t = self.broadcast_vec(Tensor::from_slice(&values))?;
        Ok(Vec::<i64>::try_from(&t)?)
    }

    /// Rank 0's bytes on every rank (what the others pass is ignored).
    pub fn broadcast_bytes(&self, bytes: Vec<u8>) -> Result<Vec<u8>> {
        let t = self.broadcast_vec(Tensor::from_slice(&bytes))?;
        Ok(Vec::<u8>::try_from(&t)?)
    }

    /// Rank 0's 1-d CPU tensor `t` on every rank, whatever its length there.
    fn broadcast_vec(&self, t: Tensor) -> Result<Tensor> {
        let len = Tensor::from_slice(&[t.numel() as i64]).to_device(self.device);
        self.broadcast_from_first(std::slice::from_ref(&len))?;
        let len = len.int64_value(&[0]);
        if len == 0 {
            return Ok(t.narrow(0, 0, 0));
        }
        let t = match self.is_first() {
            true => t.to_device(self.device),
            false => Tensor::zeros([len], (t.kind(), self.device)),
        };
        self.broadcast_from_first(std::slice::from_ref(&t))?;
        Ok(t.to_device(Device::Cpu))
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

    /// Reduces the gradients of the trainable tensors over the ranks, each to the rank that
    /// owns the tensor (ZeRO's reduce-scatter: half an all-reduce's traffic), which alone
    /// then holds its mean; other ranks' copies of it are left stale, since only the owner
    /// updates it. A tensor that got no gradient on this rank (say, an expert no local token
    /// reached) first gets a zero one, so every rank reduces the same list.
    pub fn reduce_gradients(&self) -> Result<()> {
        let all: Vec<usize> = (0..self.trained.len()).collect();
        for p in self.start_reduce(&all, "gradients")? {
            p.finish()
                .with_context(|| format!("rank {}: reducing gradients", self.rank()))?;
        }
        Ok(())
    }

    /// Starts reducing, as [`DataParallel::reduce_gradients`], the gradients of the trainable
    /// tensors of `stage`, which the staged backward has just completed; the reduces run
    /// while backward goes on. Finish every returned reduce before the optimizer step.
    pub fn start_stage(&self, stage: Stage) -> Result<Vec<PendingMean>> {
        let of_stage: Vec<usize> = (0..self.trained.len())
            .filter(|&i| self.stage[i] == stage)
            .collect();
        self.start_reduce(&of_stage, &format!("{stage:?}"))
    }

    /// One reduce per owner rank of the gradients of tensors `which`, in rank order (the
    /// same on every rank, as c10d requires).
    fn start_reduce(&self, which: &[usize], what: &str) -> Result<Vec<PendingMean>> {
        // A tensor no token reached this batch (an expert) still joins the reduce.
        let of: Vec<Tensor> = which
            .iter()
            .map(|&i| self.trained[i].shallow_clone())
            .collect();
        spes_model::define_grads(&of);
        let mut pending = Vec::new();
        for r in 0..self.world() {
            let grads: Vec<Tensor> = which
                .iter()
                .filter(|&&i| self.owner[i] == r)
                .map(|&i| self.trained[i].grad())
                .collect();
            if grads.is_empty() {
                continue;
            }
            let p = tch::no_grad(|| self.group.start_reduce_mean(&grads, r))
                .with_context(|| format!("rank {}: reducing {what} to rank {r}", self.rank()))?;
            pending.push(p);
        }
        Ok(pending)
    }

    /// Clips the gradients to a global L2 norm of `max_norm`, each rank scaling those of the
    /// tensors it owns (the only ones reduced there); returns the pre-clip norm, the same on
    /// every rank.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<Tensor> {
        let owned: Vec<Tensor> = self
            .owned_by(self.rank())
            .map(|i| self.trained[i].grad())
            .collect();
        let part = tch::no_grad(|| spes_ext::sq_norm(&owned))?
            .unwrap_or_else(|| Tensor::zeros([], (Kind::Float, self.device)));
        self.average(std::slice::from_ref(&part))?;
        let norm = tch::no_grad(|| (part * self.world() as f64).sqrt());
        tch::no_grad(|| spes_ext::clip_to_norm(&owned, &norm, max_norm))?;
        Ok(norm)
    }

    /// After each rank updated the tensors it owns: every rank receives every owner's.
    pub fn share_updates(&self) -> Result<()> {
        for r in 0..self.world() {
            let owned: Vec<Tensor> = self
                .owned_by(r)
                .map(|i| self.trained[i].shallow_clone())
                .collect();
            tch::no_grad(|| self.group.broadcast(&owned, r))
                .with_context(|| format!("rank {}: sharing rank {r}'s update", self.rank()))?;
        }
        Ok(())
    }

    /// Zeroes the gradients of every trainable tensor.
    pub fn zero_grads(&self) -> Result<()> {
        let grads: Vec<Tensor> = self
            .trained
            .iter()
            .map(Tensor::grad)
            .filter(Tensor::defined)
            .collect();
        Ok(spes_ext::zero(&grads)?)
    }

    fn owned_by(&self, r: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.owner.len()).filter(move |&i| self.owner[i] == r)
    }

    /// Every rank's AdamW moments (and noise averages), in the optimizer's checkpoint format: on rank 0 (in host
    /// memory), `None` on the others. Every rank must call it; owners send their moments a
    /// bucket at a time, so no other rank ever holds more than a bucket of them.
    pub fn gather_optimizer_state(&self, opt: &AdamW) -> Result<Option<Vec<(String, Tensor)>>> {
        let mine: std::collections::HashMap<String, Tensor> = opt.state().into_iter().collect();
        let mut out = Vec::new();
        for r in 0..self.world() {
            let owned: Vec<usize> = self.owned_by(r).collect();
            for chunk in owned.chunks(64) {
                let (mut moments, mut names) = (Vec::new(), Vec::new());
                for &i in chunk {
                    for prefix in ["exp_avg", "exp_avg_sq", "noise"] {
                        let key = format!("{prefix}.{}", self.names[i]);
                        let t = match mine.get(&key) {
                            Some(t) if r == self.rank() => t.shallow_clone(),
                            _ => self.trained[i].zeros_like(),
                        };
                        moments.push(t);
                        names.push(key);
                    }
                }
                // Each tensor's start step, then whether it has a noise average.
                let mut flags: Vec<i64> = chunk
                    .iter()
                    .map(|&i| match mine.get(&format!("started.{}", self.names[i])) {
                        Some(t) if r == self.rank() => t.int64_value(&[]),
                        _ => 0,
                    })
                    .collect();
                flags.extend(chunk.iter().map(|&i| {
                    (r == self.rank() && mine.contains_key(&format!("noise.{}", self.names[i])))
                        as i64
                }));
                let device = self.trained[chunk[0]].device();
                moments.push(Tensor::from_slice(&flags).to_device(device));
                self.group.broadcast(&moments, r).with_context(|| {
                    format!("rank {}: gathering rank {r}'s moments", self.rank())
                })?;
                if self.is_first() {
                    let flags = Vec::<i64>::try_from(
                        &moments.pop().expect("started").to_device(Device::Cpu),
                    )?;
                    let (started, noisy) = flags.split_at(chunk.len());
                    for (k, (name, t)) in names.into_iter().zip(moments).enumerate() {
                        if k % 3 < 2 || noisy[k / 3] != 0 {
                            out.push((name, t.to_device(Device::Cpu)));
                        }
                    }
                    for (&i, &s) in chunk.iter().zip(started) {
                        if s != 0 {
                            out.push((format!("started.{}", self.names[i]), Tensor::from(s)));
                        }
                    }
                }
            }
        }
        Ok(self.is_first().then_some(out))
    }

    /// Fails unless every rank's trainable tensors equal rank 0's bit for bit (compared
    /// through a checksum of each tensor's bits), naming the first tensor that differs.
    pub fn check_in_sync(&self) -> Result<()> {
        let mine = tch::no_grad(|| {
            let sums: Vec<Tensor> = self.trained.iter().map(bit_checksum).collect();
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
                self.names[i]
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

#[cfg(test)]
mod tests {
    use super::partition;

    #[test]
    fn partition_is_even_and_deterministic() {
        let sizes = [100, 7, 50, 50, 3, 90, 1, 60];
        let owner = partition(&sizes, 2);
        assert_eq!(owner, partition(&sizes, 2));
        let load = |r| -> i64 {
            (0..sizes.len())
                .filter(|&i| owner[i] == r)
                .map(|i| sizes[i])
                .sum()
        };
        assert_eq!(load(0) + load(1), 361);
        // Largest-first greedy is within 7/6 of the best split for two ranks.
        assert!(
            load(0).max(load(1)) as f64 <= 7.0 / 6.0 * 361.0 / 2.0,
            "{} vs {}",
            load(0),
            load(1)
        );
        assert_eq!(partition(&sizes, 1), vec![0; 8]);
        // More ranks than tensors: some ranks own nothing, none owns two.
        let few = partition(&[5, 4], 3);
        assert_ne!(few[0], few[1]);
    }
}
