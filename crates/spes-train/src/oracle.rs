//! Oracles of `spes simulate`: measuring tools, not training features. Each gives every node,
//! at every step, one statistic of the union of all nodes' batches in place of its own, while
//! everything else stays local (the node's data, first moment, step and learning rate). What
//! an oracle gains over the same run without it is what that statistic of a node's small batch
//! costs (docs/results/quality.md#oracles).
//!
//! The union gradient of a tensor is the mean of the gradients of the nodes that train it
//! (equal rows a node, so the mean over the union's rows). Under DiLoCo every node trains
//! every tensor; under SPES an expert has one trainer, its owner, so for experts the oracles
//! change nothing and they cover the shared tensors (and the router, through load balancing).

use crate::trainer::{StepStats, Trainer};
use anyhow::{bail, Result};
use std::collections::HashMap;
use tch::Tensor;

/// Which statistics come from the union of the nodes' batches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Oracle {
    /// AdamW's second moment is fed the square of the union gradient (after clipping).
    pub second_moment: bool,
    /// Gradients are clipped by the union gradient's global norm.
    pub clip: bool,
    /// The load-balancing loss counts each expert's assignments over the union's tokens.
    pub load_balance: bool,
}

impl Oracle {
    /// The names `--oracle` takes, and `all`.
    pub const NAMES: [&'static str; 4] = ["second-moment", "clip", "load-balance", "all"];

    /// Parses a list of names from [`Oracle::NAMES`].
    pub fn parse(names: &[String]) -> Result<Oracle> {
        let mut o = Oracle::default();
        for name in names {
            match name.as_str() {
                "second-moment" => o.second_moment = true,
                "clip" => o.clip = true,
                "load-balance" => o.load_balance = true,
                "all" => {
                    o = Oracle {
                        second_moment: true,
                        clip: true,
                        load_balance: true,
                    }
                }
                other => bail!(
                    "unknown oracle `{other}`: expected one of {}",
                    Oracle::NAMES.join(", ")
                ),
            }
        }
        Ok(o)
    }

    /// Whether any statistic comes from the union.
    pub fn any(&self) -> bool {
        self.second_moment || self.clip || self.load_balance
    }
}

/// One step of every trainer, `rows` rows each, in phases: every forward and backward, then
/// clipping, then every AdamW update, the statistics `oracle` names taken from the union.
pub fn lockstep(
    trainers: &mut [&mut Trainer],
    rows: usize,
    oracle: Oracle,
) -> Result<Vec<StepStats>> {
    let batches = trainers
        .iter_mut()
        .map(|t| t.draw_step(rows))
        .collect::<Result<Vec<_>>>()?;
    if oracle.load_balance {
        if batches[0].len() != 1 {
            bail!("the load-balance oracle needs one micro-batch a step (train.micro_batch unset)");
        }
        let counts = trainers
            .iter()
            .zip(&batches)
            .map(|(t, b)| t.routing_counts(&b[0]))
            .reduce(|a, b| a + b)
            .expect("at least one node")
            / trainers.len() as f64;
        for t in trainers.iter_mut() {
            t.model.set_lb_counts(Some(counts.shallow_clone()));
        }
    }
    let backwards: Vec<_> = trainers
        .iter()
        .zip(&batches)
        .map(|(t, b)| t.backward_step(b))
        .collect();
    if oracle.load_balance {
        for t in trainers.iter_mut() {
            t.model.set_lb_counts(None);
        }
    }
    let union_norm = match oracle.clip {
        true => Some(norm(&union_grads(trainers))?),
        false => None,
    };
    let norms = trainers
        .iter()
        .map(|t| t.clip_step(union_norm.as_ref()))
        .collect::<Result<Vec<_>>>()?;
    let second = oracle.second_moment.then(|| {
        let mut union = union_grads(trainers);
        for g in union.values_mut() {
            *g = g.square();
        }
        union
    });
    trainers
        .iter_mut()
        .zip(backwards)
        .zip(norms)
        .map(|((t, b), n)| t.finish_step(b, n, second.as_ref()))
        .collect()
}

/// Each trained tensor's union gradient: the mean over the nodes that have its gradient.
fn union_grads(trainers: &[&mut Trainer]) -> HashMap<String, Tensor> {
    let mut sums: HashMap<String, (Tensor, usize)> = HashMap::new();
    for t in trainers {
        for (name, g) in t.opt.named_grads() {
            match sums.get_mut(&name) {
                Some((sum, n)) => {
                    let _ = sum.g_add_(&g);
                    *n += 1;
                }
                None => {
                    sums.insert(name, (g.detach().copy(), 1));
                }
            }
        }
    }
    sums.into_iter()
        .map(|(name, (sum, n))| (name, sum / n as f64))
        .collect()
}

/// The global L2 norm of some tensors, an fp32 scalar.
fn norm(grads: &HashMap<String, Tensor>) -> Result<Tensor> {
    let mut names: Vec<&String> = grads.keys().collect();
    // A fixed order: a sum over a hash map's order would vary in its last bits.
    names.sort();
    let ts: Vec<Tensor> = names.iter().map(|n| grads[*n].shallow_clone()).collect();
    Ok(spes_ext::sq_norm(&ts)?.map_or_else(|| Tensor::from(0f32), |s| s.sqrt()))
}
