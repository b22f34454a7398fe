//! What a round's close makes of the combined uploads: the next global model and, on the delta
//! wires, what the round publishes. Three passes in this order, which decides the bits every
//! node reproduces:
//!
//! 1. [`Coordinator::fates`]: each tensor's fate — unchanged; a value (the fp32 wire's
//!    combined value, or on the delta wires an owner's expert published verbatim on a round
//!    without a merge); or a change still to encode, after the norm-preserving scale (averaged
//!    tensors) and the outer step.
//! 2. [`Coordinator::merge`]: on merge rounds, similar experts mixed; a merged expert's fate
//!    becomes its change from the base.
//! 3. [`Coordinator::encode`]: each change in the wire's form (lossy wires add the residual of
//!    earlier rounds and keep what they leave out; a round that sends changes whole, a lossless
//!    wire's or the run's last, sends every residual with them), the
//!    model being the base plus the published delta, computed as every node computes it.
//!
//! [`Coordinator::publish`] runs them and keeps the result unless it is not finite.

use super::{first_non_finite, Coordinator};
use crate::delta::{self, Delta, RoundDelta};
use crate::named::Named;
use crate::outer::{norm_preserving_scale, Source};
use crate::round::{merge_experts, Combined, MergeEvent};
use tch::{Kind, Tensor};

/// A tensor's fate in a round's close.
enum Next {
    Unchanged,
    /// Its next value: the combined value (fp32 wire), or an owner's expert published as sent.
    Value(Tensor),
    /// Its change from the base, still to encode for the wire (delta wires).
    Change(Tensor),
}

/// The first pass's result.
struct Fates {
    /// One per tensor of the global model, in its order.
    next: Vec<Next>,
    /// What is published so far: the verbatim experts.
    out: RoundDelta,
    /// The outer optimizer's new momenta, kept only if the round is.
    momenta: Named,
    /// [`super::RoundReport::outer_scale`].
    outer_scale: Option<f64>,
}

/// What a close kept of the round, for its report.
pub(super) struct Kept {
    pub merge_alpha: Option<f64>,
    pub merges: Vec<MergeEvent>,
    /// Why the round's result was discarded (the previous model kept).
    pub discarded: Option<String>,
    pub outer_scale: Option<f64>,
}

impl Coordinator {
    /// Whether the open round sends every change whole, with every residual the lossy rounds
    /// before held back: on a lossless wire, and on the run's last round.
    fn sends_whole(&self) -> bool {
        !self.cfg.wire().is_lossy() || self.last_round == Some(self.round)
    }

    /// The next model from `combined`, merged with `merge_alpha` on merge rounds, and what the
    /// round publishes; kept unless what decides the model is not finite (then the previous
    /// model stays and the round publishes nothing).
    pub(super) fn publish(&mut self, combined: Combined, merge_alpha: Option<f64>) -> Kept {
        let mut fates = self.fates(combined, merge_alpha);
        let merges = merge_alpha.map_or_else(Vec::new, |a| self.merge(&mut fates.next, a));
        let (global, published) = self.encode(fates.next, fates.out);
        // The published delta decides the model (base + delta, base finite): check it alone.
        let changed = published.as_ref().map_or(&global, |p| &p.delta);
        let discarded = first_non_finite(changed).map(|name| {
            format!("the aggregate of `{name}` is not finite; the previous model was kept")
        });
        if discarded.is_some() {
            self.last_delta = self.cfg.wire().is_delta().then(RoundDelta::default);
            return Kept {
                merge_alpha: None,
                merges: Vec::new(),
                discarded,
                outer_scale: fates.outer_scale,
            };
        }
        self.global = global;
        self.last_delta = published;
        self.outer.commit(fates.momenta);
        Kept {
            merge_alpha,
            merges,
            discarded: None,
            outer_scale: fates.outer_scale,
        }
    }

    /// Pass 1: each tensor's fate. An owned expert's previous owner's unsent change (handed
    /// over) joins its new owner's; an owned expert on a delta wire, on a round without a
    /// merge and with the average as its outer rule, is published as its owner sent it.
    fn fates(&mut self, combined: Combined, merge_alpha: Option<f64>) -> Fates {
        let Combined {
            mut averaged,
            spread,
            uploads,
            mut owned,
            mut handover,
        } = combined;
        let delta_wire = self.cfg.wire().is_delta();
        // Σ scale·numel and Σ numel over the averaged changes, for the report.
        let mut scaled = (0.0, 0.0);
        let verbatim =
            delta_wire && merge_alpha.is_none() && self.cfg.outer_rule(Source::Owned).is_average();
        // A round that sends changes whole sends every residual with them: an expert that
        // owes one is not published as its owner sent it.
        let flush = self.sends_whole();
        let mut out = RoundDelta::default();
        let mut momenta = Vec::new();
        let mut next: Vec<Next> = Vec::with_capacity(self.global.len());
        for (name, base) in &self.global {
            let mut combined = averaged.remove(name).map(|t| (Source::Averaged, t));
            let handed = handover.remove(name);
            if let Some((peer, d)) = owned.remove(name) {
                if verbatim && handed.is_none() && !(flush && self.residual.contains_key(name)) {
                    let mut value = base.copy();
                    d.apply_(&mut value);
                    let wire = d.into_wire(name);
                    let names = wire.iter().map(|(n, _)| n.clone());
                    out.verbatim.entry(peer).or_default().extend(names);
                    out.delta.extend(wire);
                    next.push(Next::Value(value));
                    continue;
                }
                let t = match d {
                    Delta::Value(t) => t.to_kind(Kind::Float),
                    d => d.to_f32(base),
                };
                combined = Some((Source::Owned, handed.map_or(t.shallow_clone(), |h| t + h)));
            } else if let Some(h) = handed {
                combined = Some((Source::Owned, h));
            }
            let Some((source, t)) = combined else {
                next.push(Next::Unchanged);
                continue;
            };
            let rule = self.cfg.outer_rule(source);
            if !delta_wire {
                // The combined value itself, or the base plus the outer step on its change.
                next.push(Next::Value(if rule.is_average() {
                    t
                } else {
                    let step = self.outer.step(name, rule, &t - base);
                    momenta.extend(step.momentum.map(|m| (name.clone(), m)));
                    base + step.change
                }));
                continue;
            }
            let mut c = t;
            if let (Source::Averaged, Some(&mean_sq)) = (source, spread.get(name)) {
                let norm = c.norm_scalaropt_dtype(2, Kind::Float).double_value(&[]);
                let scale = norm_preserving_scale(mean_sq, norm * norm, uploads);
                if scale != 1.0 {
                    c *= scale;
                }
                scaled.0 += scale * c.numel() as f64;
                scaled.1 += c.numel() as f64;
            }
            if !rule.is_average() {
                let step = self.outer.step(name, rule, c);
                momenta.extend(step.momentum.map(|m| (name.clone(), m)));
                c = step.change;
            }
            next.push(Next::Change(c));
        }
        Fates {
            next,
            out,
            momenta,
            outer_scale: (scaled.1 > 0.0).then(|| scaled.0 / scaled.1),
        }
    }

    /// Pass 2: merges similar experts with weight `alpha` on the values the fates give; every
    /// expert the merge touched becomes its change from the base (or its value, fp32 wire).
    fn merge(&self, next: &mut [Next], alpha: f64) -> Vec<MergeEvent> {
        let mut values: Named = next
            .iter()
            .zip(&self.global)
            .map(|(n, (name, b))| {
                let v = match n {
                    Next::Unchanged => b.shallow_clone(),
                    Next::Value(v) => v.shallow_clone(),
                    Next::Change(c) => b + c,
                };
                (name.clone(), v)
            })
            .collect();
        let merges = merge_experts(
            &mut values,
            &self.layout,
            self.cfg.merge_top_k,
            alpha,
            self.cfg.merge_similarity,
        );
        let delta_wire = self.cfg.wire().is_delta();
        // The merge replaced every expert it touched: its change is now from the base.
        for ((n, (_, value)), (_, base)) in next.iter_mut().zip(values).zip(&self.global) {
            if value.data_ptr() != base.data_ptr() {
                *n = if delta_wire {
                    Next::Change(value - base)
                } else {
                    Next::Value(value)
                };
            }
        }
        merges
    }

    /// Pass 3: the next model and (delta wires) the round's delta, `out` holding the verbatim
    /// experts already. Lossy wires add the residual and keep what the round leaves out; a
    /// round that sends changes whole (a lossless wire after lossy rounds, or the run's last
    /// round) sends every residual with them, in bf16.
    fn encode(&mut self, next: Vec<Next>, mut out: RoundDelta) -> (Named, Option<RoundDelta>) {
        let lossy = !self.sends_whole();
        let mut global: Named = Vec::with_capacity(self.global.len());
        for (n, (name, base)) in next.into_iter().zip(&self.global) {
            let n = match n {
                Next::Unchanged if !lossy && self.residual.contains_key(name) => {
                    Next::Change(Tensor::zeros_like(base))
                }
                n => n,
            };
            let value = match n {
                Next::Unchanged => base.shallow_clone(),
                Next::Value(v) => v,
                Next::Change(mut v) if lossy => {
                    if let Some(r) = self.residual.get(name) {
                        v += r;
                    }
                    let d = Delta::of_change(&v, &self.cfg, self.round);
                    let mut value = base.copy();
                    d.apply_(&mut value);
                    self.residual.insert(name.clone(), d.subtract_from(&v));
                    out.delta.extend(d.into_wire(name));
                    value
                }
                Next::Change(mut v) => {
                    if let Some(r) = self.residual.remove(name) {
                        v += r;
                    }
                    let (d, value) = delta::encode_into(base, v);
                    out.delta.extend(d.into_wire(name));
                    value
                }
            };
            global.push((name.clone(), value));
        }
        (global, self.cfg.wire().is_delta().then_some(out))
    }
}
