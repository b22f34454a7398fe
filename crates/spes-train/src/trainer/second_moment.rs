//! `train.second_moment = "union_estimate"`: what a node's AdamW second moment is fed for the
//! tensors the server averages over the nodes.
//!
//! One step on the union of M nodes' batches has the mean gradient μ and 1/M of a node's
//! noise variance σ²/B, so its square is on average μ² + σ²/(MB), where a node's own is
//! μ² + σ²/B: a node's second moment is too large wherever noise dominates, and the average
//! of the nodes' steps up to √M shorter there than the centralized step (the oracles of
//! docs/results/quality.md measure what that costs). Two halves of the node's batch, of r₁
//! and r₂ rows, give gradients g₁ and g₂ whose squared difference measures the noise of
//! their mean g: s = (g₁ − g₂)² · r₁r₂ / (r₁ + r₂)² has expectation σ²/B. So the node feeds
//! g² − (1 − 1/M)·s, kept within [g²/M, g²], the range the union's square lies in.

use crate::config::{Mode, RunConfig, SecondMoment};
use spes_model::{MoeModel, Role};
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// Estimates the union's squared gradient for the tensors averaged over `nodes` nodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UnionEstimate {
    pub nodes: usize,
    /// Whether expert matrices are averaged too (DiLoCo) or each is its owner's (SPES).
    pub experts: bool,
}

/// The gradients of a step's first half of rows, kept when the second half starts.
pub struct FirstHalf {
    /// `(name, r₁/(r₁+r₂) · g₁)`: the step's gradient as it stood after the first half.
    grads: Vec<(String, Tensor)>,
    rows: (i64, i64),
}

impl UnionEstimate {
    /// The estimate `cfg` asks for, if any.
    pub fn of(cfg: &RunConfig) -> Option<UnionEstimate> {
        (cfg.train.second_moment == SecondMoment::UnionEstimate).then_some(UnionEstimate {
            nodes: cfg.sync.nodes,
            experts: cfg.sync.mode == Mode::Diloco,
        })
    }

    /// Copies the gradients of the tensors it estimates for, after the step's first `rows.0`
    /// rows (of `rows.0 + rows.1`).
    pub(super) fn first_half(&self, model: &MoeModel, rows: (i64, i64)) -> FirstHalf {
        let grads = model
            .trainable_params()
            .into_iter()
            .filter(|p| self.experts || !matches!(p.role, Role::Expert { .. }))
            .map(|p| (p.name, p.tensor.grad().detach().copy()))
            .collect();
        FirstHalf { grads, rows }
    }

    /// What each tensor's second moment is fed, from the whole step's gradients before
    /// clipping and the first half's.
    pub(super) fn squares(&self, model: &MoeModel, half: FirstHalf) -> HashMap<String, Tensor> {
        let grads: HashMap<String, Tensor> = model
            .trainable_params()
            .into_iter()
            .map(|p| (p.name, p.tensor.grad()))
            .collect();
        tch::no_grad(|| {
            half.grads
                .into_iter()
                .map(|(name, h1)| {
                    let fed = fed(&grads[&name], &h1, half.rows, self.nodes);
                    (name, fed)
                })
                .collect()
        })
    }
}

/// The estimated union square of one tensor: `g` its step's gradient, `h1` the gradient as it
/// stood after the first `rows.0` of the step's rows (`rows.0 / (rows.0 + rows.1) · g₁`).
fn fed(g: &Tensor, h1: &Tensor, rows: (i64, i64), nodes: usize) -> Tensor {
    let (r1, r2) = (rows.0 as f64, rows.1 as f64);
    let total = r1 + r2;
    let g1 = h1 * (total / r1);
    let g2 = (g - h1) * (total / r2);
    let noise = (g1 - g2).square() * (r1 * r2 / (total * total));
    let own = g.square();
    (&own - noise * (1.0 - 1.0 / nodes as f64)).maximum(&(&own / nodes as f64))
}

/// Scales squared gradients as clipping to `max_norm` scaled gradients of pre-clip norm
/// `norm`: by min(1, max_norm / (norm + 1e-6))², torch's clip_grad_norm_ coefficient.
pub(super) fn clip_squares(squares: &mut HashMap<String, Tensor>, norm: &Tensor, max_norm: f64) {
    let k = (norm.to_kind(Kind::Float) + 1e-6)
        .reciprocal()
        .g_mul_scalar(max_norm)
        .clamp_max(1.0)
        .square();
    tch::no_grad(|| {
        for t in squares.values_mut() {
            let _ = t.g_mul_(&k);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the halves agree the gradient is all signal and is fed whole; where they cancel
    /// it is all noise and is fed at the union's 1/M.
    #[test]
    fn signal_is_fed_whole_and_noise_at_one_over_the_nodes() {
        let g1 = Tensor::from_slice(&[2.0f32, 1.0, 3.0]);
        let g2 = Tensor::from_slice(&[0.0f32, 1.0, -1.0]);
        // Two halves of 2 rows: the step's gradient is their mean, h1 half of g1.
        let g = (&g1 + &g2) / 2.0;
        let got = Vec::<f32>::try_from(fed(&g, &(&g1 / 2.0), (2, 2), 4)).unwrap();
        // g = [1, 1, 1]; noise (g1 − g2)²/4 = [1, 0, 4]; g² − ¾·noise = [0.25, 1, −2], at
        // least g²/4.
        assert_eq!(got, [0.25, 1.0, 0.25]);
        // Halves of 1 and 3 rows weigh their gradients by rows.
        let g = (&g1 * 1.0 + &g2 * 3.0) / 4.0;
        let got = Vec::<f32>::try_from(fed(&g, &(&g1 / 4.0), (1, 3), 1)).unwrap();
        let own = Vec::<f32>::try_from(g.square()).unwrap();
        assert_eq!(got, own, "one node: its own square");
    }
}
