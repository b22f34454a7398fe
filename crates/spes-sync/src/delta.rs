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

use crate::config::{SyncConfig, Wire};
use crate::named::Named;
use std::collections::{BTreeMap, HashMap};
use tch::{Kind, Tensor};

/// One tensor's round change as it travels, in one of the wire forms of [`Wire`].
#[derive(Debug)]
pub enum Delta {
    /// `wire = "fp32"`: the new value itself (fp32, or bf16 from a node that rounds), not a
    /// difference.
    Value(Tensor),
    /// `wire = "bf16_delta"`: the whole change in bf16.
    Dense(Tensor),
    /// `wire = "sparse_delta"`: the largest entries of the change.
    Sparse(Sparse),
    /// `wire = "int8_delta" | "int4_delta" | "int2_delta"`: the change quantized.
    Quantized(Quantized),
}

impl Delta {
    /// The change `change` (fp32) in the wire form of `cfg.wire` (not `fp32`, which sends
    /// values: [`Delta::Value`]).
    pub fn of_change(change: &Tensor, cfg: &SyncConfig) -> Delta {
        match cfg.wire {
            Wire::Fp32 => unreachable!("the fp32 wire sends values, not changes"),
            Wire::Bf16Delta => Delta::Dense(tch::no_grad(|| change.to_kind(Kind::BFloat16))),
            Wire::SparseDelta => Delta::Sparse(top_k(
                change,
                sparse_k(change.numel() as i64, cfg.sparse_density),
            )),
            wire => Delta::Quantized(quantize(
                change,
                wire.quantized_bits().expect("a quantized wire"),
            )),
        }
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
            Delta::Sparse(s) => apply_sparse_(base, s),
            Delta::Quantized(q) => {
                let d = q.on(base.device()).dequantize(base.numel() as i64);
                let _ = base.g_add_(&d.view(base.size().as_slice()));
            }
        })
    }

    /// `f32(self)` as a dense tensor shaped like `like`, on its device.
    pub fn to_f32(&self, like: &Tensor) -> Tensor {
        tch::no_grad(|| match self {
            Delta::Value(t) | Delta::Dense(t) => t.to_device(like.device()).to_kind(Kind::Float),
            Delta::Sparse(s) => dense(s, like),
            Delta::Quantized(q) => q
                .on(like.device())
                .dequantize(like.numel() as i64)
                .view(like.size().as_slice()),
        })
    }

    /// `x − f32(self)`.
    pub fn subtract_from(&self, x: &Tensor) -> Tensor {
        tch::no_grad(|| match self {
            Delta::Sparse(s) => {
                let mut out = x.copy();
                let neg = Sparse {
                    idx: s.idx.shallow_clone(),
                    val: -&s.val,
                };
                apply_sparse_(&mut out, &neg);
                out
            }
            _ => x - self.to_f32(x),
        })
    }

    /// The L2 norm of `f32(self)` (fp32 scalar), without decoding a compressed delta.
    pub fn norm(&self) -> Tensor {
        match self {
            Delta::Value(t) | Delta::Dense(t) => t.norm(),
            Delta::Sparse(s) => s.val.norm(),
            Delta::Quantized(q) => q.norm(),
        }
    }

    fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Delta {
        match self {
            Delta::Value(t) => Delta::Value(f(t)),
            Delta::Dense(t) => Delta::Dense(f(t)),
            Delta::Sparse(s) => Delta::Sparse(s.map(f)),
            Delta::Quantized(q) => Delta::Quantized(q.map(f)),
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
            Delta::Sparse(s) => s.val.device(),
            Delta::Quantized(q) => q.codes.device(),
        }
    }

    /// The wire tensors of tensor `name`: itself, or its two parts.
    pub fn into_wire(self, name: &str) -> Vec<(String, Tensor)> {
        match self {
            Delta::Value(t) | Delta::Dense(t) => vec![(name.to_owned(), t)],
            Delta::Sparse(s) => vec![
                (WirePart::Idx.name(name), s.idx),
                (WirePart::Val.name(name), s.val),
            ],
            Delta::Quantized(q) => vec![
                (WirePart::Codes.name(name), q.codes),
                (WirePart::Scale.name(name), q.scale),
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

/// The wire tensors (name, shape, kind) that carry tensor `name` of `shape` in `cfg.wire`:
/// what an upload or a published round of it takes, exactly.
pub fn wire_entries(cfg: &SyncConfig, name: &str, shape: &[i64]) -> Vec<(String, Vec<i64>, Kind)> {
    let numel = shape.iter().product();
    match cfg.wire {
        Wire::Fp32 => vec![(name.to_owned(), shape.to_vec(), Kind::Float)],
        Wire::Bf16Delta => vec![(name.to_owned(), shape.to_vec(), Kind::BFloat16)],
        Wire::SparseDelta => {
            let k = sparse_k(numel, cfg.sparse_density);
            vec![
                (WirePart::Idx.name(name), vec![k], Kind::Int),
                (WirePart::Val.name(name), vec![k], Kind::BFloat16),
            ]
        }
        wire => {
            let bits = wire.quantized_bits().expect("a quantized wire");
            let (groups, bytes) = quantized_sizes(numel, bits);
            vec![
                (WirePart::Codes.name(name), vec![bytes], Kind::Uint8),
                (WirePart::Scale.name(name), vec![groups], Kind::BFloat16),
            ]
        }
    }
}

/// The deltas a payload of `cfg.wire` carries, each checked: tensors the layout of `shape_of`
/// knows, each once, the kind and shape of its wire form; compressed parts paired (`name#…`)
/// with their sizes, sparse indices unique and in range, quantized scales not negative. Says
/// what is wrong otherwise. The one place that turns wire tensors back into deltas, for the
/// server's uploads and the node's published rounds alike.
pub fn decode<'a>(
    named: Named,
    cfg: &SyncConfig,
    shape_of: impl Fn(&str) -> Option<&'a [i64]>,
) -> Result<Deltas, String> {
    let unknown = |name: &str| format!("holds unknown tensor `{name}`");
    let Some((first, second)) = parts_of(cfg.wire) else {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::with_capacity(named.len());
        for (name, t) in named {
            let shape = shape_of(&name).ok_or_else(|| unknown(&name))?;
            if !seen.insert(name.clone()) {
                return Err(format!("holds tensor `{name}` twice"));
            }
            if t.size() != shape {
                return Err(format!(
                    "tensor `{name}` has shape {:?}, expected {shape:?}",
                    t.size()
                ));
            }
            let d = match (cfg.wire, t.kind()) {
                (Wire::Fp32, Kind::Float | Kind::BFloat16) => Delta::Value(t),
                (Wire::Bf16Delta, Kind::BFloat16) => Delta::Dense(t),
                (Wire::Fp32, k) => {
                    return Err(format!("tensor `{name}` is {k:?}, expected f32 or bf16"))
                }
                (_, k) => {
                    return Err(format!(
                    "tensor `{name}` is {k:?}, expected a bf16 delta (sync.wire = \"bf16_delta\")"
                ))
                }
            };
            out.push((name, d));
        }
        return Ok(out);
    };
    let mut order: Vec<String> = Vec::new();
    let mut parts: HashMap<String, (Option<Tensor>, Option<Tensor>)> = HashMap::new();
    for (wire, t) in named {
        let Some((name, part)) =
            split_wire_name(&wire).filter(|(_, p)| *p == first || *p == second)
        else {
            return Err(format!(
                "holds `{wire}`, expected `<tensor>{}` and `<tensor>{}` pairs ({:?})",
                first.name(""),
                second.name(""),
                cfg.wire
            ));
        };
        if shape_of(name).is_none() {
            return Err(unknown(name));
        }
        let slot = parts.entry(name.to_owned()).or_insert_with(|| {
            order.push(name.to_owned());
            (None, None)
        });
        let place = if part == first {
            &mut slot.0
        } else {
            &mut slot.1
        };
        if place.replace(t).is_some() {
            return Err(format!("holds tensor `{wire}` twice"));
        }
    }
    order
        .into_iter()
        .map(|name| {
            let (a, b) = parts.remove(&name).expect("every name has a slot");
            let (Some(a), Some(b)) = (a, b) else {
                return Err(format!(
                    "tensor `{name}` lacks its {} or {} part",
                    first.name(""),
                    second.name("")
                ));
            };
            let numel: i64 = shape_of(&name).expect("checked").iter().product();
            let d = from_parts(cfg, numel, a, b).map_err(|e| format!("tensor `{name}`: {e}"))?;
            Ok((name, d))
        })
        .collect()
}

/// The two wire parts a lossy form sends per tensor, in [`from_parts`] order.
fn parts_of(wire: Wire) -> Option<(WirePart, WirePart)> {
    match wire {
        Wire::SparseDelta => Some((WirePart::Idx, WirePart::Val)),
        w if w.quantized_bits().is_some() => Some((WirePart::Codes, WirePart::Scale)),
        _ => None,
    }
}

/// The delta of a tensor of `numel` values from its two wire parts, checked.
fn from_parts(
    cfg: &SyncConfig,
    numel: i64,
    first: Tensor,
    second: Tensor,
) -> Result<Delta, String> {
    if let Some(bits) = cfg.wire.quantized_bits() {
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
        return Ok(Delta::Quantized(Quantized { codes, scale, bits }));
    }
    let (idx, val) = (first, second);
    let k = sparse_k(numel, cfg.sparse_density);
    if idx.kind() != Kind::Int
        || idx.size() != [k]
        || val.kind() != Kind::BFloat16
        || val.size() != [k]
    {
        return Err(format!(
            "expected {k} int32 indices and {k} bf16 values, got {:?} {:?} and {:?} {:?}",
            idx.kind(),
            idx.size(),
            val.kind(),
            val.size()
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
    Ok(Delta::Sparse(Sparse { idx, val }))
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

/// Sparse deltas (`sync.wire = "sparse_delta"`): per tensor, the `k = ⌈density·n⌉` entries of
/// largest magnitude as (int32 flat index, bf16 value) pairs, 6 bytes each. Applying is an
/// in-place `index_add_` of unique indices, one correctly rounded addition per entry.
#[derive(Debug)]
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

/// The tensor a compressed delta's wire name belongs to, and which part it names.
pub fn split_wire_name(wire: &str) -> Option<(&str, WirePart)> {
    WirePart::ALL
        .into_iter()
        .find_map(|p| wire.strip_suffix(p.suffix()).map(|n| (n, p)))
}

/// The tensor a wire tensor belongs to: its name without a part suffix.
pub fn tensor_of(wire: &str) -> &str {
    split_wire_name(wire).map_or(wire, |(n, _)| n)
}

/// Entries a tensor of `numel` values sends per round.
pub fn sparse_k(numel: i64, density: f64) -> i64 {
    ((density * numel as f64).ceil() as i64).clamp(1, numel.max(1))
}

/// The `k` largest-magnitude entries of `v` (fp32), values rounded to bf16.
fn top_k(v: &Tensor, k: i64) -> Sparse {
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
fn apply_sparse_(base: &mut Tensor, s: &Sparse) {
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
fn dense(s: &Sparse, like: &Tensor) -> Tensor {
    let mut out = Tensor::zeros_like(like).to_kind(Kind::Float);
    apply_sparse_(&mut out, s);
    out
}

/// Quantized deltas (`sync.wire = "int8_delta" | "int4_delta" | "int2_delta"`): a tensor's
/// delta, flattened and zero-padded to whole groups of [`GROUP`] values, as one bf16 scale per
/// group and a `bits`-bit signed code per value (packed little-end first into bytes): value =
/// code · scale. 8 and 4 bits scale by the group's largest magnitude (codes −127..127, −7..7);
/// 2 bits send −1, 0 or 1 times the group's mean magnitude, which keeps more of a round's
/// change than the largest would. A code times a bf16 scale needs at most 15 significant bits,
/// so dequantizing is exact and the global model stays bit-identical everywhere; what a round
/// leaves out is carried over (error feedback) as on the sparse wire.
#[derive(Debug)]
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
        for wire in [
            Wire::Int4Delta,
            Wire::Int2Delta,
            Wire::SparseDelta,
            Wire::Bf16Delta,
        ] {
            let cfg = SyncConfig {
                wire,
                sparse_density: 0.1,
                ..SyncConfig::default()
            };
            let c = Delta::of_change(&v, &cfg);
            let mut applied = base.copy();
            c.apply_(&mut applied);
            assert!(applied.equal(&(&base + c.to_f32(&base))), "{wire:?}");
            assert!(c.subtract_from(&v).equal(&(&v - c.to_f32(&v))), "{wire:?}");
            // Norms of bf16 parts are bf16 (8 significant bits); quantized ones fp32.
            let n = (
                c.norm().double_value(&[]),
                c.to_f32(&v).norm().double_value(&[]),
            );
            assert!((n.0 - n.1).abs() <= 1e-2 * n.1, "{wire:?}: {n:?}");
        }
    }

    #[test]
    fn decode_pairs_the_parts_of_what_into_wire_made_and_refuses_strays() {
        let v = sample();
        let shape = [10i64, 100];
        let shape_of = |n: &str| (n == "w").then_some(&shape[..]);
        for wire in [Wire::Int8Delta, Wire::SparseDelta, Wire::Bf16Delta] {
            let cfg = SyncConfig {
                wire,
                ..SyncConfig::default()
            };
            let named = Delta::of_change(&v, &cfg).into_wire("w");
            let back = decode(named, &cfg, shape_of).unwrap();
            assert_eq!(back.len(), 1);
            let want = Delta::of_change(&v, &cfg).to_f32(&v);
            assert!(back[0].1.to_f32(&v).equal(&want), "{wire:?}");
            let mut twice = Delta::of_change(&v, &cfg).into_wire("w");
            twice.extend(Delta::of_change(&v, &cfg).into_wire("w"));
            assert!(decode(twice, &cfg, shape_of).unwrap_err().contains("twice"));
            let stray = Delta::of_change(&v, &cfg).into_wire("x");
            let e = decode(stray, &cfg, shape_of).unwrap_err();
            assert!(e.contains("unknown tensor `x`"), "{e}");
        }
        let cfg = SyncConfig {
            wire: Wire::Int4Delta,
            ..SyncConfig::default()
        };
        let mut half = Delta::of_change(&v, &cfg).into_wire("w");
        half.pop();
        let e = decode(half, &cfg, shape_of).unwrap_err();
        assert!(e.contains("lacks its #q or #scale part"), "{e}");
        let e = decode(vec![("w".into(), v.copy())], &cfg, shape_of).unwrap_err();
        assert!(e.contains("expected `<tensor>#q`"), "{e}");
    }
}
