//! The server's outer optimizer (DiLoCo's): a round's change of a tensor, Δ = combined − θ_r,
//! is a negative pseudo-gradient, and SGD with (Nesterov) momentum on it gives the next model:
//! `m ← μ·m + Δ`, then `θ_{r+1} = θ_r + lr·(Δ + μ·m)` (Nesterov) or `θ_r + lr·m`.
//! lr 1 with μ 0 is the plain average of docs/design/algorithm.md §4, the default. Averaged tensors and owned
//! experts (taken from their owner) have separate rules, since an expert's change is one
//! node's and not a mean that averaging has shrunk.
//!
//! Averaging does shrink: n nodes' AdamW changes agree on the signal but their noise partly
//! cancels, so the mean moves less than one node's change would, while a centralized step on
//! the n-fold batch moves as far as one node's (AdamW's steps are about `lr` whatever the
//! batch) with less noise. [`norm_preserving_scale`] undoes that shrinkage per tensor (a cousin
//! of FedExP's server extrapolation, Jhunjhunwala et al., ICLR 2023).

use crate::named::Named;
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// SGD on a round's change: learning rate, momentum μ, and whether the step looks ahead.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OuterRule {
    pub lr: f64,
    pub momentum: f64,
    pub nesterov: bool,
}

impl OuterRule {
    /// Take the combined value as it is (docs/design/algorithm.md §4).
    pub const AVERAGE: OuterRule = OuterRule {
        lr: 1.0,
        momentum: 0.0,
        nesterov: false,
    };

    /// Whether this rule leaves every change as it is.
    pub fn is_average(&self) -> bool {
        self.lr == 1.0 && self.momentum == 0.0
    }
}

/// Which rule a tensor's change gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Combined over the nodes that uploaded it.
    Averaged,
    /// One expert, from its owner.
    Owned,
}

/// The factor that gives a tensor's combined change Δ̄ of `n` uploads back the RMS size of the
/// uploaded changes Δᵢ, whose squared norms average `mean_sq`: `√(mean_sq / ‖Δ̄‖²)`, clamped to
/// [1, √n]. Nodes that agree (signal-dominated changes, early training) get 1, plain averaging;
/// independent noise, whose mean is √n times smaller, gets √n, which is what a centralized
/// step on the n-fold batch would move in that limit.
pub fn norm_preserving_scale(mean_sq: f64, combined_sq: f64, n: usize) -> f64 {
    let most = (n.max(1) as f64).sqrt();
    if !(combined_sq > 0.0 && mean_sq.is_finite()) {
        return 1.0;
    }
    (mean_sq / combined_sq).sqrt().clamp(1.0, most)
}

/// Each tensor's momentum, kept only under rules with μ > 0 and carried over server restarts
/// ([`OuterState::state`]).
#[derive(Default)]
pub struct OuterState {
    momentum: HashMap<String, Tensor>,
}

/// A step's result: the change to apply, and the momentum to keep once the round is accepted.
pub struct OuterStep {
    pub change: Tensor,
    pub momentum: Option<Tensor>,
}

impl OuterState {
    /// The change to apply for `change` under `rule`, computed in fp32; the tensor's momentum
    /// is not updated until [`OuterState::commit`] (a round whose result is discarded must not
    /// move it).
    pub fn step(&self, name: &str, rule: OuterRule, change: Tensor) -> OuterStep {
        if rule.momentum == 0.0 {
            let change = if rule.lr == 1.0 {
                change
            } else {
                change * rule.lr
            };
            return OuterStep {
                change,
                momentum: None,
            };
        }
        let change = change.to_kind(Kind::Float);
        let m = match self.momentum.get(name) {
            Some(m) => m * rule.momentum + &change,
            None => change.copy(),
        };
        let step = if rule.nesterov {
            (&change + &m * rule.momentum) * rule.lr
        } else {
            &m * rule.lr
        };
        OuterStep {
            change: step,
            momentum: Some(m),
        }
    }

    /// Keeps the momenta of an accepted round.
    pub fn commit(&mut self, momenta: Vec<(String, Tensor)>) {
        self.momentum.extend(momenta);
    }

    /// Every tensor's momentum, by name in sorted order (for the server's restart point).
    pub fn state(&self) -> Named {
        crate::named::sorted(&self.momentum)
    }

    /// Restores what [`OuterState::state`] returned.
    pub fn restore(&mut self, named: Named) {
        self.momentum = named.into_iter().collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v)
    }

    fn vec(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t).unwrap()
    }

    #[test]
    fn nesterov_momentum_matches_the_formula_over_rounds() {
        let rule = OuterRule {
            lr: 0.7,
            momentum: 0.9,
            nesterov: true,
        };
        let mut st = OuterState::default();
        let (d1, d2) = ([1.0f32, -2.0], [0.5f32, 1.0]);
        let s1 = st.step("w", rule, t(&d1));
        // m1 = Δ1; step = lr·(Δ1 + μ·m1) = lr·1.9·Δ1.
        assert_eq!(vec(&s1.change), vec![0.7 * 1.9, -0.7 * 3.8]);
        st.commit(vec![("w".into(), s1.momentum.unwrap())]);
        let s2 = st.step("w", rule, t(&d2));
        // m2 = μ·m1 + Δ2; step = lr·(Δ2 + μ·m2).
        let m2 = [0.9 * 1.0 + 0.5, 0.9 * -2.0 + 1.0];
        let want: Vec<f32> = (0..2).map(|i| 0.7 * (d2[i] + 0.9 * m2[i])).collect();
        for (got, want) in vec(&s2.change).iter().zip(&want) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
        assert_eq!(vec(s2.momentum.as_ref().unwrap()), m2.to_vec());
    }

    #[test]
    fn heavy_ball_steps_by_the_momentum_and_uncommitted_rounds_leave_no_trace() {
        let rule = OuterRule {
            lr: 0.5,
            momentum: 0.5,
            nesterov: false,
        };
        let mut st = OuterState::default();
        let s1 = st.step("w", rule, t(&[2.0]));
        assert_eq!(vec(&s1.change), vec![1.0]);
        // Not committed (a discarded round): the next step starts from no momentum again.
        let s2 = st.step("w", rule, t(&[2.0]));
        assert_eq!(vec(&s2.change), vec![1.0]);
        st.commit(vec![("w".into(), s2.momentum.unwrap())]);
        let s3 = st.step("w", rule, t(&[2.0]));
        assert_eq!(vec(&s3.change), vec![0.5 * (0.5 * 2.0 + 2.0)]);
        let mut restored = OuterState::default();
        restored.restore(st.state());
        assert_eq!(
            vec(&restored.step("w", rule, t(&[2.0])).change),
            vec(&s3.change)
        );
    }

    #[test]
    fn norm_preserving_scale_is_one_for_agreement_and_sqrt_n_for_noise() {
        // Four identical changes: nothing to undo.
        assert_eq!(norm_preserving_scale(4.0, 4.0, 4), 1.0);
        // Four orthogonal unit changes: the mean has norm² 4/16, so the factor is 2 = √4.
        assert_eq!(norm_preserving_scale(1.0, 0.25, 4), 2.0);
        // Partly opposed changes would call for more; never beyond √n.
        assert_eq!(norm_preserving_scale(1.0, 0.01, 4), 2.0);
        // Between the two.
        let s = norm_preserving_scale(1.0, 0.5, 4);
        assert!((s - 2f64.sqrt()).abs() < 1e-12, "{s}");
        // No change at all, or a single upload: plain averaging.
        assert_eq!(norm_preserving_scale(0.0, 0.0, 4), 1.0);
        assert_eq!(norm_preserving_scale(1.0, 0.25, 1), 1.0);
    }

    #[test]
    fn the_average_rule_changes_nothing() {
        let st = OuterState::default();
        let s = st.step("w", OuterRule::AVERAGE, t(&[0.25, -1.0]));
        assert!(OuterRule::AVERAGE.is_average());
        assert_eq!(vec(&s.change), vec![0.25, -1.0]);
        assert!(s.momentum.is_none());
    }
}
