//! Exact bf16 deltas (the `sync.wire = "bf16_delta"` protocol). Everybody keeps the last
//! published global model θ_r in fp32. A node uploads `bf16(θ_node − θ_r)`; the server rebuilds
//! each upload as `θ_r + f32(delta)`, aggregates and merges in fp32 as before, then publishes
//! `Δ = bf16(θ_ideal − θ_r)` and sets `θ_{r+1} = θ_r + f32(Δ)`. Every node computes the same
//! `θ_r + f32(Δ)` with [`apply`]: bf16→f32 is exact and one fp32 addition is correctly
//! rounded on every device, so server and nodes hold bit-identical fp32 models, and no fp32
//! master is ever rounded to bf16 wholesale — only each round's *change* is (relative error
//! 2⁻⁹ of the change, not of the weight).
//!
//! An expert taken from its owner on a round without a merge is published as the owner's own
//! upload, bit for bit, so the owner need not download it back ([`RoundDelta::verbatim`]); a
//! tensor that did not change is not published at all (a missing tensor is a zero delta).

use crate::round::Named;
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

/// The wire form of `value − base`.
pub fn encode(value: &Tensor, base: &Tensor) -> Tensor {
    tch::no_grad(|| (value - base).to_kind(Kind::BFloat16))
}

/// `base + f32(delta)` on `base`'s device: the one formula the server and every node use.
pub fn apply(base: &Tensor, delta: &Tensor) -> Tensor {
    tch::no_grad(|| base + delta.to_device(base.device()).to_kind(Kind::Float))
}

/// In place: `base ← base + f32(delta)`, with the same bits as [`apply`].
pub fn apply_(base: &mut Tensor, delta: &Tensor) {
    tch::no_grad(|| {
        let _ = base.g_add_(&delta.to_device(base.device()).to_kind(Kind::Float));
    });
}

/// What a round publishes in delta mode.
#[derive(Default)]
pub struct RoundDelta {
    /// The changed tensors' deltas (bf16), in the model's order.
    pub delta: Named,
    /// `verbatim[p]`: names of tensors in `delta` that are peer p's own upload, bit for bit.
    pub verbatim: BTreeMap<usize, Vec<String>>,
}

impl RoundDelta {
    /// Total bytes of the published deltas.
    pub fn bytes(&self) -> u64 {
        self.delta.iter().map(|(_, t)| t.numel() as u64 * 2).sum()
    }
}
