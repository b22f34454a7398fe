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
    /// The changed tensors' deltas in wire form (bf16, or sparse pairs).
    pub delta: Named,
    /// `verbatim[p]`: wire names of entries in `delta` that are peer p's own upload, bit for bit.
    pub verbatim: BTreeMap<usize, Vec<String>>,
}

impl RoundDelta {
    /// Total bytes of the published deltas.
    pub fn bytes(&self) -> u64 {
        self.delta.iter().map(|(_, t)| t.numel() as u64 * 2).sum()
    }
}

/// Sparse deltas (`sync.wire = "sparse_delta"`): per tensor, the `k = ⌈density·n⌉` entries of
/// largest magnitude as (int32 flat index, bf16 value) pairs, 6 bytes each; everything else
/// stays where it was and is sent in later rounds (error feedback): a node keeps what it has
/// not sent in its own weights, the server keeps it in a residual. Applying is an in-place
/// `index_add_` of unique indices, one correctly rounded addition per entry, so server and
/// nodes still hold bit-identical fp32 global models.
pub struct Sparse {
    /// Flat indices (int32), unique.
    pub idx: Tensor,
    /// Values (bf16), one per index.
    pub val: Tensor,
}

impl Sparse {
    /// The shallow copy of both parts.
    pub fn share(&self) -> Sparse {
        Sparse {
            idx: self.idx.shallow_clone(),
            val: self.val.shallow_clone(),
        }
    }

    /// The two wire tensors of tensor `name`.
    pub fn into_wire(self, name: &str) -> [(String, Tensor); 2] {
        [(idx_name(name), self.idx), (val_name(name), self.val)]
    }
}

/// Wire name of a sparse delta's indices.
pub fn idx_name(name: &str) -> String {
    format!("{name}#idx")
}

/// Wire name of a sparse delta's values.
pub fn val_name(name: &str) -> String {
    format!("{name}#val")
}

/// The tensor a sparse wire name belongs to, and whether it names the indices.
pub fn split_wire_name(wire: &str) -> Option<(&str, bool)> {
    wire.strip_suffix("#idx")
        .map(|n| (n, true))
        .or_else(|| wire.strip_suffix("#val").map(|n| (n, false)))
}

/// Entries a tensor of `numel` values sends per round.
pub fn sparse_k(numel: i64, density: f64) -> i64 {
    ((density * numel as f64).ceil() as i64).clamp(1, numel.max(1))
}

/// The `k` largest-magnitude entries of `v` (fp32), values rounded to bf16.
pub fn top_k(v: &Tensor, k: i64) -> Sparse {
    tch::no_grad(|| {
        let flat = v.reshape([-1]);
        let (_, idx) = flat.abs().topk(k, 0, true, false);
        let val = flat.index_select(0, &idx).to_kind(Kind::BFloat16);
        Sparse {
            idx: idx.to_kind(Kind::Int),
            val,
        }
    })
}

/// In place: `base ← base + f32(s)` at `s`'s indices.
pub fn apply_sparse_(base: &mut Tensor, s: &Sparse) {
    tch::no_grad(|| {
        let dev = base.device();
        let _ = base.view([-1]).index_add_(
            0,
            &s.idx.to_device(dev).to_kind(Kind::Int64),
            &s.val.to_device(dev).to_kind(Kind::Float),
        );
    });
}

/// `f32(s)` as a dense tensor shaped like `like`.
pub fn dense(s: &Sparse, like: &Tensor) -> Tensor {
    let mut out = Tensor::zeros_like(like).to_kind(Kind::Float);
    apply_sparse_(&mut out, s);
    out
}

/// What uploads and published rounds carry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum WireForm {
    /// Whole fp32 tensors.
    Values,
    /// Dense bf16 deltas.
    Bf16Delta,
    /// Sparse deltas of `density` of each tensor's entries.
    Sparse { density: f64 },
}
