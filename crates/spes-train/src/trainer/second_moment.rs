//! `train.second_moment = "union_estimate"`: what a node's AdamW divides by for the tensors
//! the server averages over the nodes.
//!
//! One step on the union of M nodes' batches has the mean gradient μ and 1/M of a node's
//! noise variance σ²/B, so its square is on average μ² + σ²/(MB), where a node's own is
//! μ² + σ²/B: a node's second moment is too large wherever noise dominates, and the average
//! of the nodes' steps up to √M shorter there than the centralized step (the oracles of
//! docs/results/quality.md measure what that costs). Two halves of the node's batch, of r₁
//! and r₂ rows, give gradients g₁ and g₂ whose squared difference measures the noise of
//! their mean g: s = (g₁ − g₂)² · r₁r₂ / (r₁ + r₂)² has expectation σ²/B. One step's s is
//! a one-sample estimate, too noisy to subtract step by step (kept within its range, it
//! would recover only a third of the correction), so AdamW averages it over steps as it
//! averages g² ([`crate::optim::AdamW::step_with_noise`]) and divides by
//! v − (1 − 1/M)·s̄, at least v/M.

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
    /// `(name, tensor, r₁/(r₁+r₂) · g₁)`: each estimated tensor (sharing storage) and its
    /// gradient as it stood after the first half.
    grads: Vec<(String, Tensor, Tensor)>,
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
            .map(|p| {
                let h1 = p.tensor.grad().detach().copy();
                (p.name, p.tensor, h1)
            })
            .collect();
        FirstHalf { grads, rows }
    }
}

impl FirstHalf {
    /// The noise variance of each estimated tensor's step gradient, from the whole step's
    /// gradients (before clipping) and the first half's.
    pub(super) fn noise(self) -> HashMap<String, Tensor> {
        tch::no_grad(|| {
            self.grads
                .into_iter()
                .map(|(name, t, h1)| (name, noise(&t.grad(), &h1, self.rows)))
                .collect()
        })
    }
}

/// The noise variance of one tensor's step gradient `g`, from `h1`, the gradient as it stood
/// after the first `rows.0` of the step's rows (`rows.0 / (rows.0 + rows.1) · g₁`).
fn noise(g: &Tensor, h1: &Tensor, rows: (i64, i64)) -> Tensor {
    let (r1, r2) = (rows.0 as f64, rows.1 as f64);
    let total = r1 + r2;
    let g1 = h1 * (total / r1);
    let g2 = (g - h1) * (total / r2);
    (g1 - g2).square() * (r1 * r2 / (total * total))
}

/// Scales squares of gradients (their noise variances) as clipping to `max_norm` scaled
/// gradients of pre-clip norm `norm`: by min(1, max_norm / (norm + 1e-6))², torch's
/// clip_grad_norm_ coefficient.
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

    /// The halves' difference is the noise: none where they agree, a quarter of its square
    /// for equal halves, weighed by rows for unequal ones.
    #[test]
    fn the_halves_difference_measures_the_noise() {
        let g1 = Tensor::from_slice(&[2.0f32, 1.0, 3.0]);
        let g2 = Tensor::from_slice(&[0.0f32, 1.0, -1.0]);
        let g = (&g1 + &g2) / 2.0;
        let got = Vec::<f32>::try_from(noise(&g, &(&g1 / 2.0), (2, 2))).unwrap();
        assert_eq!(got, [1.0, 0.0, 4.0]);
        // 1 and 3 rows: (g1 − g2)² · 3/16.
        let g = (&g1 * 1.0 + &g2 * 3.0) / 4.0;
        let got = Vec::<f32>::try_from(noise(&g, &(&g1 / 4.0), (1, 3))).unwrap();
        assert_eq!(got, [0.75, 0.0, 3.0]);
    }
}
