//! What a round's changes travel as: one [`Delta`] per tensor, in the wire form of the run's
//! `sync.wire` (docs/design/wire-formats.md).
//!
//! On the delta wires everybody keeps the last published global model θ_r in fp32. A node
//! uploads its change `θ_node − θ_r`; the server folds the uploads into fp32 sums, merges in
//! fp32 as before, then publishes each tensor's change Δ in the same wire form and sets
//! `θ_{r+1} = θ_r + f32(Δ)`. Every node computes the same `θ_r + f32(Δ)` with
//! [`Delta::apply_`]: decoding a bf16 value, a sparse entry or a quantized code is exact, and one
//! fp32 addition is correctly rounded on every device, so server and nodes hold bit-identical
//! fp32 models, and no fp32 master is ever rounded to bf16 wholesale — only each round's
//! *change* is (relative error 2⁻⁹ of the change, not of the weight).
//!
//! An expert taken from its owner on a round without a merge is published as the owner's own
//! upload, bit for bit, so the owner need not download it back ([`RoundDelta::verbatim`]); a
//! tensor that did not change is not published at all (a missing tensor is a zero delta).
//!
//! The lossy forms (sparse, quantized) send a change in part; what they leave out is carried
//! over to later rounds (error feedback) in the node's weights and the server's residual, and
//! the same invariant holds.
//!
//! A delta travels as one wire tensor (`name`) or as two parts (`name#idx` and `name#val`, or
//! `name#q` and `name#scale`); [`Delta::into_wire`] makes them and [`decode`] — the one place
//! that pairs and checks them — turns them back.

mod decode;
mod fold;
mod form;
mod lowrank;
mod names;
mod quantized;
mod sparse;
#[cfg(test)]
mod tests;

pub use decode::decode;
pub use form::{wire_entries, Form};
pub use lowrank::{Factors, LowRank, FACTOR_BITS};
pub use names::{split_wire_name, tensor_of, WirePart};
pub use quantized::{quantize, quantized_sizes, Quantized, Stride, GROUP};
pub use sparse::{Chunking, Sparse};

use crate::config::{SyncConfig, Wire};
use crate::named::Named;
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

/// One tensor's round change as it travels, in one of the wire forms of [`Wire`].
#[derive(Debug)]
pub enum Delta {
    /// `wire = "fp32"`: the new value itself (fp32, or bf16 from a node that rounds), not a
    /// difference.
    Value(Tensor),
    /// `wire = "bf16_delta"`: the whole change in bf16.
    Dense(Tensor),
    /// `wire = "sparse_delta"`: the largest entries of each chunk of the change, 2 bits each.
    Sparse(Sparse),
    /// `wire = "int8_delta" | "int4_delta" | "int2_delta"`: the change quantized.
    Quantized(Quantized),
    /// `wire = "lowrank_delta"`: a matrix's change as two quantized factors of low rank.
    LowRank(LowRank),
}

impl Delta {
    /// The change `change` (fp32) in the wire form of `cfg.wire` for round `round` (not
    /// `fp32`, which sends values: [`Delta::Value`]).
    pub fn of_change(change: &Tensor, cfg: &SyncConfig, round: u64) -> Delta {
        match Form::of(cfg, &change.size(), round, false) {
            Form::Whole(Kind::Float) => unreachable!("the fp32 wire sends values, not changes"),
            Form::Whole(_) => Delta::whole(change),
            Form::Sparse(c) => Delta::Sparse(sparse::top_k(change, c)),
            Form::LowRank(f) => Delta::LowRank(lowrank::low_rank(change, f)),
            Form::Quantized { bits, stride } => {
                let flat = change.reshape([-1]);
                let picked = stride.pick(&flat, flat.numel() as i64).contiguous();
                Delta::Quantized(Quantized {
                    stride,
                    ..quantize(&picked, bits)
                })
            }
        }
    }

    /// The change `change` (fp32) whole in bf16: the `bf16_delta` form, which every delta wire
    /// also accepts (the sparse wire's small tensors, and a run's last round on a lossy wire).
    pub fn whole(change: &Tensor) -> Delta {
        Delta::Dense(tch::no_grad(|| change.to_kind(Kind::BFloat16)))
    }

    /// In place: `base ← base + f32(self)` (a value replaces `base`), the one formula the server
    /// and every node use.
    pub fn apply_(&self, base: &mut Tensor) {
        tch::no_grad(|| match self {
            Delta::Value(v) => {
                base.copy_(v);
            }
            Delta::Dense(d) => {
                let _ = base.g_add_(&d.to_device(base.device()).to_kind(Kind::Float));
            }
            Delta::Sparse(s) => s.add_into(base, 1.0),
            Delta::Quantized(q) => {
                let n = base.numel() as i64;
                let flat = base.view([-1]);
                if !fold::add_quantized(&flat, q, n) {
                    let d = q.on(base.device()).dequantize(q.stride.len(n));
                    let _ = q.stride.pick(&flat, n).g_add_(&d);
                }
            }
            Delta::LowRank(l) => {
                let (u, v) = l.decoded(base.device());
                if !fold::add_low_rank(base, &u, &v) {
                    let _ = base.g_add_(&l.product(base.device()).view_as(base));
                }
            }
        })
    }

    /// In place: `sum ← sum + f32(self)`: the server's sum of uploads, whose bits no node
    /// recomputes. Low-rank factors go through one matrix product (BLAS), several times faster
    /// than the ordered per-value formula of [`Delta::apply_`], in the sum's own kind (fp64 for
    /// them: [`Delta::sum_kind`]); every other form is added as there.
    pub fn fold_into(&self, sum: &mut Tensor) {
        match self {
            Delta::LowRank(l) => tch::no_grad(|| {
                let (u, v) = l.decoded(sum.device());
                let (f, k) = (l.factors, sum.kind());
                let _ = sum
                    .view([f.rows, f.cols])
                    .addmm_(&u.tr().to_kind(k), &v.to_kind(k));
            }),
            other => other.apply_(sum),
        }
    }

    /// The kind a sum of such deltas is kept in so that it comes out the same whatever order
    /// the uploads arrive in. Bf16 values and quantized levels (a few significant bits each)
    /// add exactly in fp32; a low-rank product has full fp32 significands, so an fp32 sum of
    /// several would round differently in another order and a run would not repeat. In fp64
    /// the products of the factors' codes (4-bit codes times bf16 scales: 24 significant bits
    /// at most) and their sums over a round are exact.
    pub(crate) fn sum_kind(&self) -> Kind {
        match self {
            Delta::LowRank(_) => Kind::Double,
            _ => Kind::Float,
        }
    }

    /// `f32(self)` as a fresh fp32 tensor shaped like `like`, summed as [`Delta::fold_into`] does.
    pub fn folded_f32(&self, like: &Tensor) -> Tensor {
        match self {
            Delta::Value(t) | Delta::Dense(t) => t.to_device(like.device()).to_kind(Kind::Float),
            compressed => {
                let mut out = Tensor::zeros(like.size().as_slice(), (Kind::Float, like.device()));
                compressed.fold_into(&mut out);
                out
            }
        }
    }

    /// `f32(self)` as a dense tensor shaped like `like`, on its device.
    pub fn to_f32(&self, like: &Tensor) -> Tensor {
        tch::no_grad(|| match self {
            Delta::Value(t) | Delta::Dense(t) => t.to_device(like.device()).to_kind(Kind::Float),
            Delta::Sparse(s) => {
                let out = Tensor::zeros(like.size().as_slice(), (Kind::Float, like.device()));
                s.add_into(&out, 1.0);
                out
            }
            Delta::Quantized(q) => {
                let out = Tensor::zeros(like.size().as_slice(), (Kind::Float, like.device()));
                Delta::Quantized(q.map(Tensor::shallow_clone)).apply_(&mut out.shallow_clone());
                out
            }
            Delta::LowRank(l) => {
                let out = Tensor::zeros(like.size().as_slice(), (Kind::Float, like.device()));
                Delta::LowRank(l.map(Tensor::shallow_clone)).apply_(&mut out.shallow_clone());
                out
            }
        })
    }

    /// Whether [`Delta::subtract_from`] is `x − f32(self)` to the bit, so `f32(self)` may be
    /// formed ahead ([`crate::replica::Preparer`]); a sparse delta subtracts its entries alone.
    pub fn subtracts_as_dense(&self) -> bool {
        !matches!(self, Delta::Sparse(_))
    }

    /// `x − f32(self)`.
    pub fn subtract_from(&self, x: &Tensor) -> Tensor {
        tch::no_grad(|| match self {
            Delta::Sparse(s) => {
                let out = x.copy();
                s.add_into(&out, -1.0);
                out
            }
            _ => x - self.to_f32(x),
        })
    }

    /// The L2 norm of `f32(self)` (fp32 scalar), without decoding a compressed delta.
    pub fn norm(&self) -> Tensor {
        match self {
            Delta::Value(t) | Delta::Dense(t) => t.norm(),
            Delta::Sparse(s) => s.entries_on(s.idx.device()).1.norm(),
            Delta::Quantized(q) => q.norm(),
            Delta::LowRank(l) => l.norm(),
        }
    }

    fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Delta {
        match self {
            Delta::Value(t) => Delta::Value(f(t)),
            Delta::Dense(t) => Delta::Dense(f(t)),
            Delta::Sparse(s) => Delta::Sparse(s.map(f)),
            Delta::Quantized(q) => Delta::Quantized(q.map(f)),
            Delta::LowRank(l) => Delta::LowRank(l.map(f)),
        }
    }

    /// A shallow copy (the same storage).
    pub fn share(&self) -> Delta {
        self.map(Tensor::shallow_clone)
    }

    /// A deep copy (its own storage).
    pub fn copy(&self) -> Delta {
        self.map(Tensor::copy)
    }

    /// The device its tensors are on.
    pub fn device(&self) -> tch::Device {
        match self {
            Delta::Value(t) | Delta::Dense(t) => t.device(),
            Delta::Sparse(s) => s.idx.device(),
            Delta::Quantized(q) => q.codes.device(),
            Delta::LowRank(l) => l.u.codes.device(),
        }
    }

    /// The wire tensors of tensor `name`: itself, or its two parts.
    pub fn into_wire(self, name: &str) -> Vec<(String, Tensor)> {
        match self {
            Delta::Value(t) | Delta::Dense(t) => vec![(name.to_owned(), t)],
            Delta::Sparse(s) => vec![
                (WirePart::Idx.name(name), s.idx),
                (WirePart::Codes.name(name), s.codes),
                (WirePart::Scale.name(name), s.scale),
            ],
            Delta::Quantized(q) => vec![
                (WirePart::Codes.name(name), q.codes),
                (WirePart::Scale.name(name), q.scale),
            ],
            // One part of codes and one of scales, each U's then V's: two header entries.
            Delta::LowRank(l) => vec![
                (
                    WirePart::Codes.name(name),
                    Tensor::cat(&[l.u.codes, l.v.codes], 0),
                ),
                (
                    WirePart::Scale.name(name),
                    Tensor::cat(&[l.u.scale, l.v.scale], 0),
                ),
            ],
        }
    }
}

/// Deltas by tensor name, in the order they were given.
pub type Deltas = Vec<(String, Delta)>;

/// Wire tensors of `deltas`, in order.
pub fn to_wire(deltas: Deltas) -> Named {
    deltas
        .into_iter()
        .flat_map(|(name, d)| d.into_wire(&name))
        .collect()
}

/// The float kind a payload of wire form `wire` stores: fp32 values, else bf16 (integer parts
/// keep their own kinds).
pub fn payload_kind(wire: Wire) -> Kind {
    if wire.is_delta() {
        Kind::BFloat16
    } else {
        Kind::Float
    }
}

/// Publishes an fp32 `change` on the bf16 wire: returns its delta and `base + f32(delta)`, the
/// latter written into `change`'s own storage (the server's sums are not needed after).
pub fn encode_into(base: &Tensor, mut change: Tensor) -> (Delta, Tensor) {
    tch::no_grad(|| {
        let d = change.to_kind(Kind::BFloat16);
        change.copy_(&d);
        change += base;
        (Delta::Dense(d), change)
    })
}

/// What a round publishes in delta mode.
#[derive(Default)]
pub struct RoundDelta {
    /// The changed tensors' deltas in wire form: bf16, or the parts of compressed deltas.
    pub delta: Named,
    /// `verbatim[p]`: wire names of entries in `delta` that are peer p's own upload, bit for bit.
    pub verbatim: BTreeMap<usize, Vec<String>>,
}

impl RoundDelta {
    /// Total bytes of the published deltas.
    pub fn bytes(&self) -> u64 {
        self.delta
            .iter()
            .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum()
    }

    /// What peer `peer` fetches of it: everything, or (`skip_own`) everything but its own
    /// experts published verbatim; and whether any were left out.
    pub fn for_peer(&self, peer: usize, skip_own: bool) -> (Named, bool) {
        let own = self.verbatim.get(&peer).filter(|_| skip_own);
        let sent = self
            .delta
            .iter()
            .filter(|(n, _)| own.is_none_or(|o| !o.contains(n)))
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        (sent, own.is_some_and(|o| !o.is_empty()))
    }
}
