//! A data-parallel node whose rank 0 is driven from outside: in a SPES node rank 0 alone talks
//! to the parameter server, and between steps it loads new weights, moves the step and changes
//! which experts it trains. Rank 0's trainer ([`Trainer::lead`]) announces every operation the
//! other ranks must take part in; they run [`follow`], doing the same in the same order, so
//! their collectives always meet.
//!
//! An announcement is a small broadcast of integers: the operation, then its arguments.

use super::Trainer;
use crate::config::RunConfig;
use crate::data_parallel::DataParallel;
use anyhow::{bail, Context, Result};
use spes_model::{MoeModel, Role};
use tch::{Device, Kind, Tensor};

/// What rank 0 announces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// No more operations: the followers return.
    Done = 0,
    /// One training step, at rank 0's step, token count and load-balancing scale.
    Step = 1,
    /// A new set of trainable tensors (one flag per model tensor).
    Retrain = 2,
    /// Rank 0's weights replace every rank's.
    Weights = 3,
    /// The optimizer moments are gathered to rank 0 (for a checkpoint).
    Gather = 4,
    /// Every rank checks that it holds rank 0's weights bit for bit.
    Check = 5,
}

impl Op {
    fn from_code(code: i64) -> Result<Op> {
        Ok(match code {
            0 => Op::Done,
            1 => Op::Step,
            2 => Op::Retrain,
            3 => Op::Weights,
            4 => Op::Gather,
            5 => Op::Check,
            _ => bail!("rank 0 announced an unknown operation {code}"),
        })
    }
}

impl Trainer {
    /// Makes this trainer rank 0 of a led data-parallel group: sends the other ranks (running
    /// [`follow`]) the config, position and weights, then announces every collective.
    pub fn lead(&mut self, dp: DataParallel) -> Result<()> {
        if !dp.is_first() {
            bail!("rank {} cannot lead: only rank 0 does", dp.rank());
        }
        dp.broadcast_bytes(serde_json::to_vec(&self.cfg)?)?;
        let mut head = vec![
            self.step as i64,
            self.tokens as i64,
            self.loader.position() as i64,
        ];
        head.extend(
            self.model
                .params()
                .iter()
                .map(|p| p.tensor.requires_grad() as i64),
        );
        dp.broadcast_ints(head)?;
        self.set_data_parallel(dp)?;
        self.leads = true;
        Ok(())
    }

    /// After rank 0 changed its weights outside a step (it loaded a global model): every
    /// rank takes them (and refreshes its bf16 copies of frozen experts). A no-op without a
    /// led group.
    pub fn publish_weights(&self) -> Result<()> {
        let Some(dp) = self.dp.as_ref().filter(|_| self.leads) else {
            return Ok(());
        };
        self.announce(Op::Weights, vec![])?;
        let params: Vec<Tensor> = self.model.params().into_iter().map(|p| p.tensor).collect();
        dp.broadcast_from_first(&params)
    }

    /// Tells the followers there is nothing more to do; they return from [`follow`].
    pub fn release_followers(&mut self) -> Result<()> {
        self.announce(Op::Done, vec![])?;
        self.leads = false;
        Ok(())
    }

    /// Announces `op` to the followers when this trainer leads a group.
    pub(crate) fn announce(&self, op: Op, args: Vec<i64>) -> Result<()> {
        if let (true, Some(dp)) = (self.leads, &self.dp) {
            dp.broadcast_ints([vec![op as i64], args].concat())?;
        }
        Ok(())
    }

    /// Announces a step with what the followers must match: rank 0's step and token count
    /// (which a load may have moved), the step's rows per rank, and its load-balancing scale
    /// (as f32 bits).
    pub(crate) fn announce_step(&self, rows: usize) -> Result<()> {
        if !self.leads {
            return Ok(());
        }
        let mut args = vec![self.step as i64, self.tokens as i64, rows as i64];
        if let Some(scale) = self.model.lb_count_scale() {
            let values = Vec::<f32>::try_from(&scale.to_device(Device::Cpu).to_kind(Kind::Float))?;
            args.extend(values.iter().map(|v| v.to_bits() as i64));
        }
        self.announce(Op::Step, args)
    }
}

/// Runs this process as a follower rank (not rank 0) of a led group on `device`: builds the
/// trainer from what rank 0 sends, then does each announced operation until rank 0 is done.
pub fn follow(dp: DataParallel, device: Device) -> Result<()> {
    let rank = dp.rank();
    let cfg: RunConfig = serde_json::from_slice(&dp.broadcast_bytes(Vec::new())?)
        .with_context(|| format!("rank {rank}: the config rank 0 sent"))?;
    let head = dp.broadcast_ints(Vec::new())?;
    // Its values are overwritten; seeded only so it draws from libtorch's generator under
    // the lock another role's (or test's) seeded model takes.
    let model = MoeModel::seeded(&cfg.model, device, cfg.train.seed)?;
    let params = model.params();
    if head.len() != 3 + params.len() {
        bail!(
            "rank {rank}: rank 0's model has {} tensors, this one {}",
            head.len().saturating_sub(3),
            params.len()
        );
    }
    let roles = roles_where(&model, &head[3..]);
    let mut tr = Trainer::with_model(cfg, device, model, |r| roles.contains(&r), head[2] as u64)?;
    (tr.step, tr.tokens) = (head[0] as u64, head[1] as u64);
    tr.set_data_parallel(dp)?;
    loop {
        let msg = joined(&tr).broadcast_ints(Vec::new())?;
        let (op, args) = msg
            .split_first()
            .with_context(|| format!("rank {rank}: an empty announcement"))?;
        match Op::from_code(*op)? {
            Op::Done => return Ok(()),
            Op::Step => {
                (tr.step, tr.tokens) = (args[0] as u64, args[1] as u64);
                let rows = args[2] as usize;
                let scale: Vec<f32> = args[3..]
                    .iter()
                    .map(|&b| f32::from_bits(b as u32))
                    .collect();
                let scale =
                    (!scale.is_empty()).then(|| Tensor::from_slice(&scale).to_device(device));
                tr.model.set_lb_count_scale(scale);
                tr.train_rows(rows)?;
            }
            Op::Retrain => {
                let roles = roles_where(&tr.model, args);
                tr.set_trainable(|r| roles.contains(&r))?;
            }
            Op::Weights => {
                let params: Vec<Tensor> = tr.model.params().into_iter().map(|p| p.tensor).collect();
                joined(&tr).broadcast_from_first(&params)?;
                tr.model.refresh_resident();
            }
            Op::Gather => {
                tr.optimizer_state()?;
            }
            Op::Check => tr.check_ranks_in_sync()?,
        }
    }
}

fn joined(tr: &Trainer) -> &DataParallel {
    tr.dp.as_ref().expect("a follower has joined its group")
}

/// The roles of the model's tensors whose flag is set (one flag per tensor, in order).
fn roles_where(model: &MoeModel, flags: &[i64]) -> Vec<Role> {
    model
        .params()
        .iter()
        .zip(flags)
        .filter(|(_, &f)| f != 0)
        .map(|(p, _)| p.role)
        .collect()
}
