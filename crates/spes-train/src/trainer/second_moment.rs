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
//!
//! A node of W data-parallel ranks needs no halves: each rank's own gradient g_r against the
//! ranks' mean G has E[(g_r − G)²] = (W − 1)·σ²/(WB), B rows a rank, so each rank estimates the
//! node's noise for the tensors it owns from the copy it keeps of g_r before the reduction. In
//! general a copy of r of a rank's B rows gives (g₁ − G)² / (W·B/r − 1), which for W = 1 and
//! r = r₁ is the halves' formula above.

use crate::config::{Mode, RunConfig, SecondMoment};
use spes_model::{Param, Role};
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// Estimates the union's squared gradient for the tensors averaged over `nodes` nodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UnionEstimate {
    pub nodes: usize,
    /// Whether expert matrices are averaged too (DiLoCo) or each is its owner's (SPES).
    pub experts: bool,
}

/// The gradients of part of a step's rows on this rank, copied before the rest of the step's
/// rows (the second half, or the other ranks') join them.
pub struct LocalPart {
    /// `(name, tensor, h)`: each estimated tensor (sharing storage) and its gradient when
    /// copied, `r/B · g₁` (a rank's whole gradient: `g₁`).
    grads: Vec<(String, Tensor, Tensor)>,
    /// `(r, B)`: rows the copies hold, of this rank's rows in the step.
    rows: (i64, i64),
    /// Ranks whose mean the finished gradient is.
    ranks: usize,
}

impl UnionEstimate {
    /// The estimate `cfg` asks for, if any.
    pub fn of(cfg: &RunConfig) -> Option<UnionEstimate> {
        (cfg.train.second_moment == SecondMoment::UnionEstimate).then_some(UnionEstimate {
            nodes: cfg.sync.nodes,
            experts: cfg.sync.mode == Mode::Diloco,
        })
    }

    /// An empty copy of `rows.0` of this rank's `rows.1` rows, on a node of `ranks` ranks.
    pub(super) fn part(&self, rows: (i64, i64), ranks: usize) -> LocalPart {
        LocalPart {
            grads: Vec::new(),
            rows,
            ranks,
        }
    }

    /// Copies into `part` the gradients, as they stand, of the tensors of `params` it
    /// estimates for (a tensor no row reached yet counts as a zero gradient).
    pub(super) fn capture<'a>(
        &self,
        part: &mut LocalPart,
        params: impl IntoIterator<Item = &'a Param>,
    ) {
        tch::no_grad(|| {
            for p in params {
                if !self.experts && matches!(p.role, Role::Expert { .. }) {
                    continue;
                }
                let g = p.tensor.grad();
                let h = if g.defined() {
                    g.detach().copy()
                } else {
                    p.tensor.zeros_like()
                };
                part.grads
                    .push((p.name.clone(), p.tensor.shallow_clone(), h));
            }
        });
    }
}

impl LocalPart {
    /// The noise variance of each estimated tensor's step gradient, from the whole step's
    /// gradients (before clipping; with several ranks, their mean) and the copied part's.
    pub(super) fn noise(self) -> HashMap<String, Tensor> {
        tch::no_grad(|| {
            self.grads
                .into_iter()
                .map(|(name, t, h)| (name, noise(&t.grad(), &h, self.rows, self.ranks)))
                .collect()
        })
    }
}

/// The noise variance of one tensor's step gradient `g` (the mean over `ranks` ranks), from
/// `h`, this rank's gradient as it stood after `rows.0` of its `rows.1` rows
/// (`rows.0 / rows.1 · g₁`).
fn noise(g: &Tensor, h: &Tensor, rows: (i64, i64), ranks: usize) -> Tensor {
    let (r, b) = (rows.0 as f64, rows.1 as f64);
    let g1 = h * (b / r);
    (g1 - g).square() / (ranks as f64 * b / r - 1.0)
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
    /// for equal halves, weighed by rows for unequal ones; two ranks' gradients measure it as
    /// two halves do.
    #[test]
    fn the_halves_difference_measures_the_noise() {
        let g1 = Tensor::from_slice(&[2.0f32, 1.0, 3.0]);
        let g2 = Tensor::from_slice(&[0.0f32, 1.0, -1.0]);
        let g = (&g1 + &g2) / 2.0;
        let got = Vec::<f32>::try_from(noise(&g, &(&g1 / 2.0), (2, 4), 1)).unwrap();
        assert_eq!(got, [1.0, 0.0, 4.0]);
        // 1 and 3 rows: (g1 − g2)² · 3/16.
        let g = (&g1 * 1.0 + &g2 * 3.0) / 4.0;
        let got = Vec::<f32>::try_from(noise(&g, &(&g1 / 4.0), (1, 4), 1)).unwrap();
        assert_eq!(got, [0.75, 0.0, 3.0]);
        // Two ranks of 2 rows each, each copy its rank's whole gradient: the same as halves.
        let g = (&g1 + &g2) / 2.0;
        for own in [&g1, &g2] {
            let got = Vec::<f32>::try_from(noise(&g, own, (2, 2), 2)).unwrap();
            assert_eq!(got, [1.0, 0.0, 4.0]);
        }
    }
}
