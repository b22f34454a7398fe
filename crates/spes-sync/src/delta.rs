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
//!
//! For slow links, deltas can also travel in part ([`Compressed`]: sparse or quantized), the
//! rest carried over to later rounds; the same invariant holds.

use crate::round::Named;
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

/// The wire form of `value − base`.
pub fn encode(value: &Tensor, base: &Tensor) -> Tensor {
    tch::no_grad(|| (value - base).to_kind(Kind::BFloat16))
}

/// `base + f32(delta)` on `base`'s device: the one formula the server and every node use.
pub fn apply(base: &Tensor, delta: &Tensor) -> Tensor {
    tch::no_grad(|| {
        // IEEE addition commutes, so adding `base` into a fresh f32 copy gives the bits of
        // `base + f32(delta)` with one allocation instead of two.
        let mut out = delta.to_device_(base.device(), Kind::Float, false, true);
        out += base;
        out
    })
}

/// Publishes an fp32 `change`: returns its wire form `bf16(change)` and `base + f32(that)`,
/// the latter written into `change`'s own storage (the server's sums are not needed after).
pub fn encode_into(base: &Tensor, mut change: Tensor) -> (Tensor, Tensor) {
    tch::no_grad(|| {
        let d = change.to_kind(Kind::BFloat16);
        change.copy_(&d);
        change += base;
        (d, change)
    })
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
    /// Both parts through `f` (a shallow copy, a deep one, a move to a device).
    fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Sparse {
        Sparse {
            idx: f(&self.idx),
            val: f(&self.val),
        }
    }

    /// The shallow copy of both parts.
    pub fn share(&self) -> Sparse {
        self.map(Tensor::shallow_clone)
    }

    /// The two wire tensors of tensor `name`.
    pub fn into_wire(self, name: &str) -> [(String, Tensor); 2] {
        [(idx_name(name), self.idx), (val_name(name), self.val)]
    }
}

/// The parts a compressed delta of one tensor travels as, each under `<tensor>#<suffix>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WirePart {
    /// Sparse: flat indices (int32).
    Idx,
    /// Sparse: values (bf16).
    Val,
    /// Quantized: packed codes (uint8).
    Codes,
    /// Quantized: one bf16 scale per group.
    Scale,
}

impl WirePart {
    const ALL: [WirePart; 4] = [
        WirePart::Idx,
        WirePart::Val,
        WirePart::Codes,
        WirePart::Scale,
    ];

    fn suffix(self) -> &'static str {
        match self {
            WirePart::Idx => "#idx",
            WirePart::Val => "#val",
            WirePart::Codes => "#q",
            WirePart::Scale => "#scale",
        }
    }

    /// The wire name of this part of tensor `name`.
    pub fn name(self, name: &str) -> String {
        format!("{name}{}", self.suffix())
    }
}

/// Wire name of a sparse delta's indices.
pub fn idx_name(name: &str) -> String {
    WirePart::Idx.name(name)
}

/// Wire name of a sparse delta's values.
pub fn val_name(name: &str) -> String {
    WirePart::Val.name(name)
}

/// The tensor a compressed delta's wire name belongs to, and which part it names.
pub fn split_wire_name(wire: &str) -> Option<(&str, WirePart)> {
    WirePart::ALL
        .into_iter()
        .find_map(|p| wire.strip_suffix(p.suffix()).map(|n| (n, p)))
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
    /// Deltas quantized to `bits` (8, 4 or 2) per value, see [`Quantized`].
    Quantized { bits: u8 },
}

impl WireForm {
    /// Whether a round's delta is sent only in part, the rest carried over (error feedback).
    pub fn is_lossy(self) -> bool {
        self.parts().is_some()
    }

    /// The two wire parts a lossy form sends per tensor, in [`Compressed::from_parts`] order.
    pub fn parts(self) -> Option<(WirePart, WirePart)> {
        match self {
            WireForm::Sparse { .. } => Some((WirePart::Idx, WirePart::Val)),
            WireForm::Quantized { .. } => Some((WirePart::Codes, WirePart::Scale)),
            WireForm::Values | WireForm::Bf16Delta => None,
        }
    }
}

/// Quantized deltas (`sync.wire = "int8_delta" | "int4_delta" | "int2_delta"`): a tensor's
/// delta, flattened and zero-padded to whole groups of [`GROUP`] values, as one bf16 scale per
/// group and a `bits`-bit signed code per value (packed little-end first into bytes): value =
/// code · scale. 8 and 4 bits scale by the group's largest magnitude (codes −127..127, −7..7);
/// 2 bits send −1, 0 or 1 times the group's mean magnitude, which keeps more of a round's
/// change than the largest would. A code times a bf16 scale needs at most 15 significant bits,
/// so dequantizing is exact and the global model stays bit-identical everywhere; what a round
/// leaves out is carried over (error feedback) as on the sparse wire.
pub struct Quantized {
    /// Packed codes (uint8), `groups · GROUP · bits / 8` bytes.
    pub codes: Tensor,
    /// One scale per group (bf16).
    pub scale: Tensor,
    /// Bits per code.
    pub bits: u8,
}

/// Values per quantization group (one bf16 scale each: 0.25 bits per value).
pub const GROUP: i64 = 64;

/// Groups and packed code bytes of a tensor of `numel` values at `bits` per code.
pub fn quantized_sizes(numel: i64, bits: u8) -> (i64, i64) {
    let groups = (numel + GROUP - 1) / GROUP;
    (groups, groups * GROUP * bits as i64 / 8)
}

/// `v` (fp32) quantized to `bits` per value.
pub fn quantize(v: &Tensor, bits: u8) -> Quantized {
    tch::no_grad(|| {
        let n = v.numel() as i64;
        let (groups, _) = quantized_sizes(n, bits);
        let flat = v.reshape([-1]).constant_pad_nd([0, groups * GROUP - n]);
        let g = flat.view([groups, GROUP]);
        let qmax = (1i64 << (bits - 1)) - 1;
        let scale = if bits == 2 {
            g.abs().mean_dim(1, true, Kind::Float)
        } else {
            g.abs().amax(1, true) / qmax as f64
        }
        .to_kind(Kind::BFloat16);
        // An all-zero group has scale 0 and codes 0 (0 / tiny), never NaN.
        let divisor = scale
            .to_kind(Kind::Float)
            .clamp_min(f32::MIN_POSITIVE as f64);
        let mut codes = (&g / divisor).round();
        let offset = (1i64 << (bits - 1)) as f64;
        let _ = codes
            .clamp_(-qmax as f64, qmax as f64)
            .g_add_scalar_(offset);
        let per = 8 / bits as i64;
        let codes = codes.to_kind(Kind::Uint8).view([-1, per]);
        // Packs `per` codes into a byte, the first in the lowest bits (uint8 arithmetic).
        let mut packed = codes.select(1, 0).copy();
        for j in 1..per {
            packed += codes.select(1, j) * (1i64 << (bits as i64 * j));
        }
        Quantized {
            codes: packed,
            scale: scale.view([groups]),
            bits,
        }
    })
}

impl Quantized {
    /// What each possible byte's codes are, `[256, 8 / bits]` (fp32): decoding by table
    /// lookup is ten times faster on CPU than unpacking with shifts.
    fn table(&self) -> Tensor {
        let bits = self.bits as i64;
        let dev = self.codes.device();
        let bytes = Tensor::arange(256, (Kind::Int64, dev));
        let shifts = Tensor::arange(8 / bits, (Kind::Int64, dev)) * bits;
        (bytes
            .unsqueeze(1)
            .bitwise_right_shift(&shifts)
            .bitwise_and((1i64 << bits) - 1)
            - (1i64 << (bits - 1)))
            .to_kind(Kind::Float)
    }

    /// The L2 norm of `f32(self)` (fp32 scalar), without decoding it: per group, the scale
    /// squared times the codes' squares summed per byte by table.
    pub fn norm(&self) -> Tensor {
        tch::no_grad(|| {
            let groups = self.scale.numel() as i64;
            let squares = self.table().square().sum_dim_intlist(1, false, Kind::Float);
            let per_group = squares
                .index_select(0, &self.codes.to_kind(Kind::Int))
                .view([groups, -1])
                .sum_dim_intlist(1, false, Kind::Float);
            (per_group * self.scale.to_kind(Kind::Float).square())
                .sum(Kind::Float)
                .sqrt()
        })
    }

    /// `f32(self)` as a dense tensor of `numel` values, flat.
    pub fn dequantize(&self, numel: i64) -> Tensor {
        tch::no_grad(|| {
            let table = self.table();
            let groups = self.scale.numel() as i64;
            let mut values = table
                .index_select(0, &self.codes.to_kind(Kind::Int))
                .view([groups, GROUP]);
            let _ = values.g_mul_(&self.scale.to_kind(Kind::Float).view([groups, 1]));
            values.view([-1]).narrow(0, 0, numel)
        })
    }

    /// Both tensors through `f` (a shallow copy, a deep one, a move to a device).
    fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Quantized {
        Quantized {
            codes: f(&self.codes),
            scale: f(&self.scale),
            bits: self.bits,
        }
    }

    /// A copy on `device`: codes travel to a GPU at 1/16 of the bytes of the fp32 values they
    /// decode to there.
    fn on(&self, device: tch::Device) -> Quantized {
        self.map(|t| t.to_device(device))
    }

    /// The two wire tensors of tensor `name`.
    pub fn into_wire(self, name: &str) -> [(String, Tensor); 2] {
        [
            (WirePart::Codes.name(name), self.codes),
            (WirePart::Scale.name(name), self.scale),
        ]
    }
}

/// A delta sent in part: sparse or quantized.
pub enum Compressed {
    Sparse(Sparse),
    Quantized(Quantized),
}

/// `v` (fp32) in the lossy wire form `form` (sparse or quantized).
pub fn compress(v: &Tensor, form: WireForm) -> Compressed {
    match form {
        WireForm::Quantized { bits } => Compressed::Quantized(quantize(v, bits)),
        WireForm::Sparse { density } => {
            Compressed::Sparse(top_k(v, sparse_k(v.numel() as i64, density)))
        }
        _ => unreachable!("compress is called for lossy wires only"),
    }
}

impl Compressed {
    /// The delta of a tensor of `numel` values from its two wire parts in `form` (in
    /// [`WireForm::parts`] order), checked: kinds and sizes, sparse indices unique and in range,
    /// quantized scales not negative. Says what is wrong otherwise.
    pub fn from_parts(
        form: WireForm,
        numel: i64,
        first: Tensor,
        second: Tensor,
    ) -> Result<Compressed, String> {
        match form {
            WireForm::Sparse { density } => {
                let (idx, val) = (first, second);
                let k = sparse_k(numel, density);
                if idx.kind() != Kind::Int
                    || idx.size() != [k]
                    || val.kind() != Kind::BFloat16
                    || val.size() != [k]
                {
                    return Err(format!(
                        "expected {k} int32 indices and {k} bf16 values, got {:?} {:?} and {:?} {:?}",
                        idx.kind(), idx.size(), val.kind(), val.size()
                    ));
                }
                let (sorted, _) = idx.sort(0, false);
                let (lo, hi) = (sorted.int64_value(&[0]), sorted.int64_value(&[k - 1]));
                let unique = k == 1
                    || bool::try_from(
                        sorted
                            .diff(1, 0, None::<Tensor>, None::<Tensor>)
                            .gt(0)
                            .all(),
                    )
                    .unwrap_or(false);
                if lo < 0 || hi >= numel || !unique {
                    return Err(format!("indices must be unique and in 0..{numel}"));
                }
                Ok(Compressed::Sparse(Sparse { idx, val }))
            }
            WireForm::Quantized { bits } => {
                let (codes, scale) = (first, second);
                let (groups, bytes) = quantized_sizes(numel, bits);
                if codes.kind() != Kind::Uint8
                    || codes.size() != [bytes]
                    || scale.kind() != Kind::BFloat16
                    || scale.size() != [groups]
                {
                    return Err(format!(
                        "expected {bytes} uint8 codes and {groups} bf16 scales ({bits}-bit), got {:?} {:?} and {:?} {:?}",
                        codes.kind(), codes.size(), scale.kind(), scale.size()
                    ));
                }
                // Negative scales would let one code mean two values; a NaN shows in the norm.
                if groups > 0 && scale.min().double_value(&[]) < 0.0 {
                    return Err("has a negative scale".into());
                }
                Ok(Compressed::Quantized(Quantized { codes, scale, bits }))
            }
            WireForm::Values | WireForm::Bf16Delta => {
                Err(format!("{form:?} sends no compressed deltas"))
            }
        }
    }

    /// The L2 norm of `f32(self)` (fp32 scalar), without decoding it.
    pub fn norm(&self) -> Tensor {
        match self {
            Compressed::Sparse(s) => s.val.norm(),
            Compressed::Quantized(q) => q.norm(),
        }
    }

    fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Compressed {
        match self {
            Compressed::Sparse(s) => Compressed::Sparse(s.map(f)),
            Compressed::Quantized(q) => Compressed::Quantized(q.map(f)),
        }
    }

    /// A shallow copy (the same storage).
    pub fn share(&self) -> Compressed {
        self.map(Tensor::shallow_clone)
    }

    /// The device its tensors are on.
    pub fn device(&self) -> tch::Device {
        match self {
            Compressed::Sparse(s) => s.val.device(),
            Compressed::Quantized(q) => q.codes.device(),
        }
    }

    /// A deep copy (its own storage).
    pub fn copy(&self) -> Compressed {
        self.map(Tensor::copy)
    }

    /// In place: `base ← base + f32(self)`, the one formula the server and every node use.
    pub fn apply_(&self, base: &mut Tensor) {
        match self {
            Compressed::Sparse(s) => apply_sparse_(base, s),
            Compressed::Quantized(q) => tch::no_grad(|| {
                let d = q.on(base.device()).dequantize(base.numel() as i64);
                let _ = base.g_add_(&d.view(base.size().as_slice()));
            }),
        }
    }

    /// `f32(self)` as a dense tensor shaped like `like`.
    pub fn dense(&self, like: &Tensor) -> Tensor {
        match self {
            Compressed::Sparse(s) => dense(s, like),
            Compressed::Quantized(q) => q
                .on(like.device())
                .dequantize(like.numel() as i64)
                .view(like.size().as_slice()),
        }
    }

    /// `x − f32(self)`.
    pub fn subtract_from(&self, x: &Tensor) -> Tensor {
        tch::no_grad(|| match self {
            Compressed::Sparse(s) => {
                let mut out = x.copy();
                let neg = Sparse {
                    idx: s.idx.shallow_clone(),
                    val: -&s.val,
                };
                apply_sparse_(&mut out, &neg);
                out
            }
            Compressed::Quantized(_) => x - self.dense(x),
        })
    }

    /// The wire tensors of tensor `name`.
    pub fn into_wire(self, name: &str) -> [(String, Tensor); 2] {
        match self {
            Compressed::Sparse(s) => s.into_wire(name),
            Compressed::Quantized(q) => q.into_wire(name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1000 values (not a whole number of groups) of mixed magnitude, one group all zero.
    fn sample() -> Tensor {
        tch::manual_seed(7);
        let v = Tensor::randn([10, 100], (Kind::Float, tch::Device::Cpu))
            * Tensor::logspace(-6.0, -2.0, 100, 10.0, (Kind::Float, tch::Device::Cpu));
        let _ = v.view([-1]).narrow(0, 64, GROUP).zero_();
        v
    }

    #[test]
    fn quantized_deltas_round_to_the_nearest_step_of_their_group() {
        let v = sample();
        for bits in [8u8, 4] {
            let q = quantize(&v, bits);
            let (groups, bytes) = quantized_sizes(1000, bits);
            assert_eq!(
                (q.scale.size(), q.codes.size()),
                (vec![groups], vec![bytes])
            );
            let d = q.dequantize(1000);
            let step = q
                .scale
                .to_kind(Kind::Float)
                .repeat_interleave_self_int(GROUP, 0, None)
                .narrow(0, 0, 1000);
            let err = (&d - v.reshape([-1])).abs();
            // Half a step, plus the bf16 rounding of the scale times the largest code.
            let qmax = ((1 << (bits - 1)) - 1) as f64;
            let slack = &step * (0.5 + qmax / 256.0);
            assert!(
                bool::try_from(err.le_tensor(&slack).all()).unwrap(),
                "{bits} bits"
            );
            assert!(bool::try_from(d.narrow(0, 64, GROUP).eq(0.0).all()).unwrap());
            let (n, m) = (q.norm().double_value(&[]), d.norm().double_value(&[]));
            assert!((n - m).abs() <= 1e-5 * m, "{bits} bits: norm {n} vs {m}");
        }
    }

    #[test]
    fn two_bit_deltas_send_minus_one_zero_or_one_mean_magnitude() {
        let v = sample();
        let q = quantize(&v, 2);
        let d = q.dequantize(1000).view([-1]);
        let padded = d.constant_pad_nd([0, 24]).view([16, GROUP]);
        let scale = q.scale.to_kind(Kind::Float).view([16, 1]);
        let code = &padded / scale.clamp_min(f32::MIN_POSITIVE as f64);
        let allowed = code.eq(0.0).logical_or(&code.abs().eq(1.0));
        assert!(bool::try_from(allowed.all()).unwrap());
        // The scale is the group's mean magnitude (bf16), so signs of large entries survive.
        let big = v.reshape([-1]).abs().gt_tensor(
            &(scale
                .repeat_interleave_self_int(GROUP, 0, None)
                .narrow(0, 0, 1000)
                .view([-1])
                * 1.5),
        );
        let agree = d
            .sign()
            .eq_tensor(&v.reshape([-1]).sign())
            .logical_or(&big.logical_not());
        assert!(bool::try_from(agree.all()).unwrap());
    }

    #[test]
    fn compressed_deltas_apply_exactly_as_their_dense_form() {
        let v = sample();
        let base = Tensor::randn([10, 100], (Kind::Float, tch::Device::Cpu));
        for form in [
            WireForm::Quantized { bits: 4 },
            WireForm::Quantized { bits: 2 },
            WireForm::Sparse { density: 0.1 },
        ] {
            let c = compress(&v, form);
            let mut applied = base.copy();
            c.apply_(&mut applied);
            assert!(applied.equal(&(&base + c.dense(&base))), "{form:?}");
            assert!(c.subtract_from(&v).equal(&(&v - c.dense(&v))), "{form:?}");
        }
    }
}
