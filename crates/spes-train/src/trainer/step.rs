//! One optimizer step: forward and backward over a step's micro-batches, then clipping and
//! AdamW, alone or as one rank of a data-parallel node.

use super::second_moment::{clip_squares, LocalPart, UnionEstimate};
use super::StepStats;
use crate::data_parallel::DataParallel;
use crate::metrics::StepLosses;
use crate::optim::AdamW;
use anyhow::{Context, Result};
use spes_ext::dist::PendingMean;
use spes_model::{LossWeights, MoeModel};
use std::collections::HashMap;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// How a step turns batches into an update.
#[derive(Clone, Copy, Debug)]
pub struct StepOptions {
    pub weights: LossWeights,
    /// Global gradient-norm clip.
    pub grad_clip: f64,
    /// Recompute blocks during backward (activation checkpointing).
    pub checkpoint: bool,
    /// Data parallel: reduce each stage's gradients as soon as backward completes them.
    pub overlap_reduce: bool,
    /// `train.second_moment = "union_estimate"` in a decentralized run (else `None`).
    pub estimate: Option<UnionEstimate>,
}

impl StepOptions {
    pub fn from_config(t: &crate::config::TrainConfig) -> Self {
        StepOptions {
            weights: LossWeights {
                z_loss: t.z_loss_weight,
                lb: t.lb_loss_weight,
                router_z: t.router_z_loss_weight,
            },
            grad_clip: t.grad_clip,
            checkpoint: t.activation_checkpointing,
            overlap_reduce: t.overlap_grad_reduce,
            estimate: None,
        }
    }
}

/// A step whose forward and backward passes are done: its gradients sit in the trained
/// tensors' `.grad` (with several ranks, some still being reduced).
pub struct Backward {
    started: Instant,
    /// The loss parts (total, ce, z, lb, router z), averaged over the step's rows.
    sums: Tensor,
    tokens: u64,
    /// Data parallel: the last batch's gradient reductions under way.
    reducing: Vec<PendingMean>,
    failed: Option<anyhow::Error>,
    /// With [`StepOptions::estimate`]: the gradients of part of the rows (the first half, or
    /// with several ranks this rank's own before the reduction).
    part: Option<LocalPart>,
}

impl Backward {
    /// The step's record once its update is done, `grad_norm` the norm clipping used.
    pub(crate) fn stats(self, grad_norm: Tensor, lr: f64) -> StepStats {
        let read = Tensor::cat(&[self.sums, grad_norm.reshape([1])], 0);
        let v = Vec::<f64>::try_from(&read.to_kind(Kind::Double).to_device(Device::Cpu))
            .expect("six scalars");
        StepStats {
            losses: StepLosses {
                loss: v[0],
                ce: v[1],
                z_loss: v[2],
                lb_loss: v[3],
                router_z_loss: v[4],
                grad_norm: v[5],
                lr,
            },
            tokens: self.tokens,
            seconds: self.started.elapsed().as_secs_f64(),
            source_tokens: Vec::new(),
        }
    }
}

/// Forward/backward over each batch (gradients averaged over batches, then over the ranks of
/// `dp`), clipping, and one AdamW update. Loss parts are averaged over ranks too; `tokens`
/// counts every rank's.
pub fn step_on_batches(
    model: &MoeModel,
    opt: &mut AdamW,
    o: &StepOptions,
    dp: Option<&DataParallel>,
    lr: f64,
    batches: &[Tensor],
) -> Result<StepStats> {
    let halves;
    let ranks = dp.map_or(1, DataParallel::world);
    let batches = match (o.estimate, batches) {
        // A node of one rank estimates from two halves of its rows: one batch becomes two (a
        // step of one row, which a round by tokens may give, is taken whole and measures no
        // noise).
        (Some(_), [one]) if ranks == 1 && one.size()[0] >= 2 => {
            let rows = one.size()[0];
            halves = one.split_with_sizes([rows / 2, rows - rows / 2], 0);
            &halves[..]
        }
        _ => batches,
    };
    let mut b = backward_batches(model, o, dp, batches);
    let optimizer = spes_ext::count::enter(spes_ext::count::Phase::Optimizer);
    let grad_norm = match dp {
        None => {
            let noise = b.part.take().map(LocalPart::noise);
            let norm = opt.clip_grad_norm(o.grad_clip)?;
            update(opt, o, noise, &norm, lr)?;
            opt.zero_grad()?;
            norm
        }
        Some(dp) => {
            if let Some(e) = b.failed.take() {
                return Err(e);
            }
            if b.reducing.is_empty() {
                dp.reduce_gradients()?;
            }
            for p in b.reducing.drain(..) {
                p.finish()
                    .with_context(|| format!("rank {}: reducing gradients", dp.rank()))?;
            }
            dp.average(std::slice::from_mut(&mut b.sums))?;
            b.tokens *= dp.world() as u64;
            let noise = b.part.take().map(LocalPart::noise);
            let norm = dp.clip_grad_norm(o.grad_clip)?;
            update(opt, o, noise, &norm, lr)?;
            dp.share_updates()?;
            dp.zero_grads()?;
            norm
        }
    };
    drop(optimizer);
    Ok(b.stats(grad_norm, lr))
}

/// AdamW's update from the clipped gradients (pre-clip norm `norm`), dividing by the union
/// estimate where the step measured its gradients' `noise` (before clipping).
fn update(
    opt: &mut AdamW,
    o: &StepOptions,
    noise: Option<HashMap<String, Tensor>>,
    norm: &Tensor,
    lr: f64,
) -> Result<()> {
    match noise.zip(o.estimate) {
        Some((mut noise, e)) => {
            clip_squares(&mut noise, norm, o.grad_clip);
            opt.step_with_noise(lr, &noise, e.nodes)
        }
        None => opt.step(lr),
    }
}

/// The forward and backward passes of a step over `batches`, each batch's gradient added to
/// the trained tensors' `.grad` at its share of the step's rows.
pub fn backward_batches(
    model: &MoeModel,
    o: &StepOptions,
    dp: Option<&DataParallel>,
    batches: &[Tensor],
) -> Backward {
    let started = Instant::now();
    let n = batches.len() as f64;
    let rows_of = |b: &Tensor| b.size()[0];
    let total_rows: i64 = batches.iter().map(rows_of).sum();
    // Micro-batches of one size weigh 1/n each, exactly as they always did; unequal ones (a
    // round by tokens) weigh by their rows, so the step's loss is the mean over its rows.
    let equal = batches.iter().all(|b| rows_of(b) == rows_of(&batches[0]));
    let share = |b: &Tensor| {
        if equal {
            1.0 / n
        } else {
            rows_of(b) as f64 / total_rows as f64
        }
    };
    // Loss parts stay on the device until one read at the end: a read is a GPU sync.
    let mut sums: Option<Tensor> = None;
    let mut tokens = 0;
    // Data parallel: the last batch's gradients are reduced to their owners stage by stage
    // while its backward runs on (the earlier batches only accumulate).
    let mut reducing = Vec::new();
    let mut failed = None;
    // With the estimate, a node of one rank copies the gradients after the first half of the
    // batches (by count), one half of its rows; each rank of several copies its whole
    // gradient of the tensors it owns before they are reduced, stage by stage when staged.
    let ranks = dp.map_or(1, DataParallel::world);
    let half = o
        .estimate
        .filter(|_| ranks == 1 && batches.len() >= 2)
        .map(|e| (e, batches.len() / 2));
    let mut part = None;
    // This rank's own tensors, each with the stage of the staged backward that completes it.
    let mut owned = Vec::new();
    if let (Some(e), Some(dp)) = (o.estimate, dp.filter(|_| ranks >= 2)) {
        part = Some(e.part((total_rows, total_rows), ranks));
        owned = (model.trainable_params().into_iter())
            .filter(|p| dp.owns(&p.name))
            .map(|p| (MoeModel::stage_of(&p.name), p))
            .collect();
    }
    // Mixed precision: every micro-batch multiplies by one set of bf16 copies, made here.
    model.begin_step();
    for (i, batch) in batches.iter().enumerate() {
        if let Some((e, n)) = half.filter(|&(_, n)| n == i) {
            let r1: i64 = batches[..n].iter().map(rows_of).sum();
            let mut first = e.part((r1, total_rows), 1);
            e.capture(&mut first, &model.trainable_params());
            part = Some(first);
        }
        let (rows, cols) = batch.size2().expect("batch is [rows, seq+1]");
        tokens += (rows * (cols - 1)) as u64;
        let l = match dp.filter(|_| o.overlap_reduce && i + 1 == batches.len()) {
            Some(dp) => model.backward_in_stages(
                batch,
                &o.weights,
                share(batch),
                o.checkpoint,
                &mut |stage| {
                    if let (Some(e), Some(part)) = (o.estimate, part.as_mut()) {
                        let of_stage = owned.iter().filter(|(s, _)| *s == stage);
                        e.capture(part, of_stage.map(|(_, p)| p));
                    }
                    if failed.is_none() {
                        match dp.start_stage(stage) {
                            Ok(p) => reducing.extend(p),
                            Err(e) => failed = Some(e),
                        }
                    }
                },
            ),
            None => model.backward(batch, &o.weights, share(batch), o.checkpoint),
        };
        let parts = Tensor::stack(&[&l.total, &l.ce, &l.z_loss, &l.lb, &l.router_z], 0);
        let parts = if equal {
            parts / n
        } else {
            parts * share(batch)
        };
        sums = Some(match sums.take() {
            Some(acc) => acc + parts,
            None => parts,
        });
    }
    model.end_step();
    if let (Some(e), Some(part), false) = (o.estimate, part.as_mut(), o.overlap_reduce) {
        e.capture(part, owned.iter().map(|(_, p)| p));
    }
    Backward {
        started,
        sums: sums.expect("at least one batch"),
        tokens,
        reducing,
        failed,
        part,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainConfig;
    use spes_model::ModelConfig;

    /// Two micro models from one seed, each stepped once on `batch`: one with the union
    /// estimate for 4 nodes, one with its own second moment on the same two halves of the
    /// rows; the largest difference of their weights after the step.
    fn estimate_moves(batch: &Tensor) -> f64 {
        let cfg = ModelConfig::preset("micro").unwrap();
        let t = TrainConfig {
            grad_clip: 0.1,
            ..TrainConfig::default()
        };
        let halves = batch.split(2, 0);
        let weights = |estimate: Option<UnionEstimate>| {
            let mut model = MoeModel::seeded(&cfg, Device::Cpu, 3).unwrap();
            model.set_trainable(|_| true);
            let mut opt = AdamW::new(model.trainable_params(), &t);
            let o = StepOptions {
                estimate,
                ..StepOptions::from_config(&t)
            };
            let batches = match estimate {
                Some(_) => vec![batch.shallow_clone()],
                None => halves.iter().map(Tensor::shallow_clone).collect(),
            };
            step_on_batches(&model, &mut opt, &o, None, 1e-2, &batches).unwrap();
            model
                .params()
                .into_iter()
                .map(|p| p.tensor.detach().copy())
                .collect::<Vec<_>>()
        };
        let est = UnionEstimate {
            nodes: 4,
            experts: true,
        };
        weights(Some(est))
            .iter()
            .zip(weights(None))
            .map(|(a, b)| (a - b).abs().max().double_value(&[]))
            .fold(0.0, f64::max)
    }

    /// A batch whose two halves are the same rows shows no noise, so the estimate feeds the
    /// node's own square and the step is AdamW's; halves of different rows step further.
    #[test]
    fn the_estimate_changes_the_step_only_by_the_noise_the_halves_show() {
        let rows = Tensor::randint(512, [2, 17], (Kind::Int64, Device::Cpu));
        let same = Tensor::cat(&[&rows, &rows], 0);
        assert!(estimate_moves(&same) < 1e-6, "{}", estimate_moves(&same));
        let other = Tensor::randint(512, [2, 17], (Kind::Int64, Device::Cpu));
        let different = Tensor::cat(&[&rows, &other], 0);
        assert!(
            estimate_moves(&different) > 1e-3,
            "{}",
            estimate_moves(&different)
        );
    }
}
