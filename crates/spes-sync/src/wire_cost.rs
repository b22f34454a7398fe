//! What each wire's code costs on a run's own tensor shapes, timed once on the machine that
//! runs it: encoding a round's change as the server publishes it, folding an upload into the
//! server's sums, and applying a download to a replica.
//!
//! The planner's rates (spes-net `plan`) were measured on `1b`, whose matrices are large. On
//! other shapes the wires stand in other ratios: on `tiny` a node applies a low-rank round in
//! 3× the time of an int4 one, where the rates say the same. A run that knows only what its
//! running wire measured needs these ratios to predict the other wires.

use crate::config::{Choice, SyncConfig, Wire};
use crate::delta::{self, Delta};
use spes_model::ModelConfig;
use std::collections::BTreeMap;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// Seconds one wire's code takes over every tensor of a model, on the machine that timed it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WireCost {
    /// The server's encoding of a round's change, error feedback included.
    pub encode_s: f64,
    /// The server's fold of an upload into its sums.
    pub fold_s: f64,
    /// A replica's apply of a published change.
    pub apply_s: f64,
}

/// Each timed wire's costs.
pub type WireCosts = BTreeMap<Wire, WireCost>;

/// Times each of the delta `wires` (the fp32 wire sends values and is left out) over every
/// tensor of `model` on the CPU, with `cfg`'s other keys.
pub fn time_model(
    model: &ModelConfig,
    cfg: &SyncConfig,
    wires: &[Wire],
) -> BTreeMap<Wire, WireCost> {
    let mut shapes = Vec::new();
    for (shape, expert) in model.shapes() {
        let n = if expert { model.n_experts } else { 1 };
        shapes.extend(std::iter::repeat_n(shape, n));
    }
    time_wires(&shapes, cfg, wires)
}

/// [`time_model`] over tensors of `shapes`. Each distinct shape is timed once (the least of
/// three tries) and counted as often as it occurs, so a model's repeated layers cost one.
fn time_wires(shapes: &[Vec<i64>], cfg: &SyncConfig, wires: &[Wire]) -> WireCosts {
    let mut counts: BTreeMap<&[i64], f64> = BTreeMap::new();
    for s in shapes {
        *counts.entry(s.as_slice()).or_default() += 1.0;
    }
    let mut out = BTreeMap::new();
    for &wire in wires.iter().filter(|w| w.is_delta()) {
        let cfg = SyncConfig {
            wire: Choice::Pinned(wire),
            ..cfg.clone()
        };
        let mut cost = WireCost::default();
        for (&shape, &count) in &counts {
            let one = (0..3)
                .map(|_| time_one(shape, &cfg))
                .reduce(|a, b| WireCost {
                    encode_s: a.encode_s.min(b.encode_s),
                    fold_s: a.fold_s.min(b.fold_s),
                    apply_s: a.apply_s.min(b.apply_s),
                })
                .unwrap_or_default();
            cost.encode_s += count * one.encode_s;
            cost.fold_s += count * one.fold_s;
            cost.apply_s += count * one.apply_s;
        }
        out.insert(wire, cost);
    }
    out
}

/// One tensor's costs on `cfg`'s wire, as the server's close and fold and a node's apply do
/// them (coordinator `next_model`, `Delta::fold_into`, `Delta::apply_`).
fn time_one(shape: &[i64], cfg: &SyncConfig) -> WireCost {
    tch::no_grad(|| {
        let numel: i64 = shape.iter().product();
        // Not drawn from torch's generator, which the run's own draws must not see moved.
        let change = (Tensor::arange(numel, (Kind::Float, Device::Cpu)) * 0.37)
            .sin()
            .reshape(shape)
            * 1e-3;
        let base = Tensor::ones(shape, (Kind::Float, Device::Cpu));
        let t = Instant::now();
        let d = Delta::of_change(&change, cfg, 1);
        if cfg.wire().is_lossy() {
            let mut value = base.copy();
            d.apply_(&mut value);
            let _ = d.subtract_from(&change);
        } else {
            let _ = delta::encode_into(&base, change.copy());
        }
        let encode_s = t.elapsed().as_secs_f64();
        let mut sum = Tensor::zeros(shape, (d.sum_kind(), Device::Cpu));
        let t = Instant::now();
        d.fold_into(&mut sum);
        let fold_s = t.elapsed().as_secs_f64();
        let mut replica = base.copy();
        let t = Instant::now();
        d.apply_(&mut replica);
        WireCost {
            encode_s,
            fold_s,
            apply_s: t.elapsed().as_secs_f64(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every delta wire asked for is timed, with positive costs, and the fp32 wire is left
    /// out; a repeated shape counts as often as it occurs.
    #[test]
    fn each_delta_wire_is_timed_over_every_tensor() {
        let cfg = SyncConfig::default();
        let wires = [
            Wire::Fp32,
            Wire::Bf16Delta,
            Wire::Int4Delta,
            Wire::LowrankDelta,
        ];
        let one = time_wires(&[vec![64, 96]], &cfg, &wires);
        assert_eq!(
            one.keys().copied().collect::<Vec<_>>(),
            vec![Wire::Bf16Delta, Wire::Int4Delta, Wire::LowrankDelta]
        );
        for c in one.values() {
            assert!(
                c.encode_s > 0.0 && c.fold_s > 0.0 && c.apply_s > 0.0,
                "{c:?}"
            );
        }
        let many = time_wires(&vec![vec![64, 96]; 50], &cfg, &[Wire::LowrankDelta]);
        let (one, many) = (one[&Wire::LowrankDelta], many[&Wire::LowrankDelta]);
        // Fifty times one tensor's least time, against one timing of it: far more than one.
        assert!(many.encode_s > 10.0 * one.encode_s, "{one:?} {many:?}");
    }
}
