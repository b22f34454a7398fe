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
        match cfg.wire {
            Wire::Fp32 => unreachable!("the fp32 wire sends values, not changes"),
            Wire::Bf16Delta => Delta::whole(change),
            Wire::SparseDelta => match Chunking::of(change.numel() as i64, cfg) {
                Some(c) => Delta::Sparse(top_k(change, c)),
                None => Delta::whole(change),
            },
            Wire::LowrankDelta => match Factors::of(&change.size(), cfg) {
                Some(f) => Delta::LowRank(low_rank(change, f)),
                None => Delta::whole(change),
            },
            wire => {
                let stride = Stride::of(cfg, round);
                let flat = change.reshape([-1]);
                let picked = stride.pick(&flat, flat.numel() as i64).contiguous();
                let bits = wire.quantized_bits().expect("a quantized wire");
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
                if !crate::fold::add_quantized(&flat, q, n) {
                    let d = q.on(base.device()).dequantize(q.stride.len(n));
                    let _ = q.stride.pick(&flat, n).g_add_(&d);
                }
            }
            Delta::LowRank(l) => {
                let (u, v) = l.decoded(base.device());
                if !crate::fold::add_low_rank(base, &u, &v) {
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

/// The wire tensors (name, shape, kind) that carry tensor `name` of `shape` in `cfg.wire`:
/// what an upload or a published round of it takes, exactly. A run's `last` round sends every
/// delta whole in bf16 ([`Delta::whole`]).
pub fn wire_entries(
    cfg: &SyncConfig,
    name: &str,
    shape: &[i64],
    round: u64,
    last: bool,
) -> Vec<(String, Vec<i64>, Kind)> {
    if last && cfg.wire.is_delta() {
        return vec![(name.to_owned(), shape.to_vec(), Kind::BFloat16)];
    }
    let numel = shape.iter().product();
    match cfg.wire {
        Wire::Fp32 => vec![(name.to_owned(), shape.to_vec(), Kind::Float)],
        Wire::Bf16Delta => vec![(name.to_owned(), shape.to_vec(), Kind::BFloat16)],
        Wire::SparseDelta => match Chunking::of(numel, cfg) {
            None => vec![(name.to_owned(), shape.to_vec(), Kind::BFloat16)],
            Some(c) => vec![
                (WirePart::Idx.name(name), vec![c.entries()], Kind::Int16),
                (
                    WirePart::Codes.name(name),
                    vec![c.code_bytes()],
                    Kind::Uint8,
                ),
                (
                    WirePart::Scale.name(name),
                    vec![2 * c.chunks()],
                    Kind::BFloat16,
                ),
            ],
        },
        Wire::LowrankDelta => match Factors::of(shape, cfg) {
            None => vec![(name.to_owned(), shape.to_vec(), Kind::BFloat16)],
            Some(f) => {
                let (groups, bytes) = f.sizes();
                vec![
                    (WirePart::Codes.name(name), vec![bytes], Kind::Uint8),
                    (WirePart::Scale.name(name), vec![groups], Kind::BFloat16),
                ]
            }
        },
        wire => {
            let bits = wire.quantized_bits().expect("a quantized wire");
            let (groups, bytes) = quantized_sizes(Stride::of(cfg, round).len(numel), bits);
            vec![
                (WirePart::Codes.name(name), vec![bytes], Kind::Uint8),
                (WirePart::Scale.name(name), vec![groups], Kind::BFloat16),
            ]
        }
    }
}

/// The deltas a payload of `cfg.wire` carries, each checked: tensors the layout of `shape_of`
/// knows, each once, the kind and shape of its wire form; compressed parts grouped (`name#…`)
/// with their sizes, sparse indices unique and in range, scales not negative. Says what is
/// wrong otherwise. The one place that turns wire tensors back into deltas, for the server's
/// uploads and the node's published rounds alike.
pub fn decode<'a>(
    named: Named,
    cfg: &SyncConfig,
    round: u64,
    shape_of: impl Fn(&str) -> Option<&'a [i64]>,
) -> Result<Deltas, String> {
    let parts = parts_of(cfg.wire);
    let mut order: Vec<String> = Vec::new();
    let mut whole: HashMap<String, Delta> = HashMap::new();
    let mut split: HashMap<String, [Option<Tensor>; 4]> = HashMap::new();
    for (wire, t) in named {
        let part = split_wire_name(&wire).filter(|(_, p)| parts.contains(p));
        let name = part.map_or(wire.as_str(), |(n, _)| n).to_owned();
        let shape = shape_of(&name).ok_or_else(|| format!("holds unknown tensor `{name}`"))?;
        let numel: i64 = shape.iter().product();
        if whole.contains_key(&name) {
            return Err(format!("holds tensor `{name}` twice"));
        }
        let Some((_, part)) = part else {
            if split.contains_key(&name) {
                return Err(format!("holds tensor `{name}` both whole and in parts"));
            }
            if t.size() != shape {
                return Err(format!(
                    "tensor `{name}` has shape {:?}, expected {shape:?}",
                    t.size()
                ));
            }
            let d = match (cfg.wire, t.kind()) {
                (Wire::Fp32, Kind::Float | Kind::BFloat16) => Delta::Value(t),
                (Wire::Fp32, k) => {
                    return Err(format!("tensor `{name}` is {k:?}, expected f32 or bf16"))
                }
                (_, Kind::BFloat16) => Delta::Dense(t),
                (_, k) => {
                    return Err(format!(
                        "tensor `{name}` is {k:?}, expected a bf16 delta (sync.wire = {:?})",
                        cfg.wire
                    ))
                }
            };
            order.push(name.clone());
            whole.insert(name, d);
            continue;
        };
        if cfg.wire == Wire::SparseDelta && Chunking::of(numel, cfg).is_none() {
            return Err(format!(
                "holds `{wire}`, but `{name}` ({numel} values, at most a chunk) travels whole in bf16"
            ));
        }
        if cfg.wire == Wire::LowrankDelta && Factors::of(shape, cfg).is_none() {
            return Err(format!(
                "holds `{wire}`, but `{name}` (shape {shape:?}) travels whole in bf16"
            ));
        }
        let slot = split.entry(name.clone()).or_insert_with(|| {
            order.push(name);
            [None, None, None, None]
        });
        let at = parts
            .iter()
            .position(|p| *p == part)
            .expect("a part of this wire");
        if slot[at].replace(t).is_some() {
            return Err(format!("holds tensor `{wire}` twice"));
        }
    }
    order
        .into_iter()
        .map(|name| {
            if let Some(d) = whole.remove(&name) {
                return Ok((name, d));
            }
            let slot = split.remove(&name).expect("every name has a slot");
            let got: Option<Vec<Tensor>> = slot.into_iter().take(parts.len()).collect();
            let Some(got) = got else {
                let list: Vec<String> = parts.iter().map(|p| p.name("")).collect();
                return Err(format!(
                    "tensor `{name}` lacks one of its {} parts ({:?})",
                    list.join(", "),
                    cfg.wire
                ));
            };
            let shape = shape_of(&name).expect("checked");
            let d =
                from_parts(cfg, round, shape, got).map_err(|e| format!("tensor `{name}`: {e}"))?;
            Ok((name, d))
        })
        .collect()
}

/// The parts a compressed form sends per tensor, in [`from_parts`] order.
fn parts_of(wire: Wire) -> &'static [WirePart] {
    match wire {
        Wire::SparseDelta => &[WirePart::Idx, WirePart::Codes, WirePart::Scale],
        Wire::LowrankDelta => &[WirePart::Codes, WirePart::Scale],
        w if w.quantized_bits().is_some() => &[WirePart::Codes, WirePart::Scale],
        _ => &[],
    }
}

/// Checks a quantized form's packed codes (`bytes` uint8) and scales (`groups` bf16, none
/// negative: a negative scale would let one code mean two values; a NaN shows in the norm);
/// `what` names the form in the error.
fn check_codes(
    codes: &Tensor,
    scale: &Tensor,
    groups: i64,
    bytes: i64,
    what: &str,
) -> Result<(), String> {
    if codes.kind() != Kind::Uint8
        || codes.size() != [bytes]
        || scale.kind() != Kind::BFloat16
        || scale.size() != [groups]
    {
        return Err(format!(
            "expected {bytes} uint8 codes and {groups} bf16 scales {what}, got {:?} {:?} and {:?} {:?}",
            codes.kind(), codes.size(), scale.kind(), scale.size()
        ));
    }
    if groups > 0 && scale.min().double_value(&[]) < 0.0 {
        return Err("has a negative scale".into());
    }
    Ok(())
}

/// The delta of a tensor of `shape` from its wire parts ([`parts_of`] order), checked.
fn from_parts(
    cfg: &SyncConfig,
    round: u64,
    shape: &[i64],
    parts: Vec<Tensor>,
) -> Result<Delta, String> {
    let numel: i64 = shape.iter().product();
    let mut parts = parts.into_iter();
    let mut next = || parts.next().expect("as many parts as parts_of says");
    if cfg.wire == Wire::LowrankDelta {
        let f = Factors::of(shape, cfg).expect("split tensors have factors");
        let (codes, scale) = (next(), next());
        let (groups, bytes) = f.sizes();
        check_codes(
            &codes,
            &scale,
            groups,
            bytes,
            &format!("of rank-{} factors", f.rank),
        )?;
        let (ug, ub) = quantized_sizes(f.rank * f.rows, FACTOR_BITS);
        let factor = |at: (i64, i64), len: (i64, i64)| Quantized {
            codes: codes.narrow(0, at.1, len.1),
            scale: scale.narrow(0, at.0, len.0),
            bits: FACTOR_BITS,
            stride: Stride::ALL,
        };
        let u = factor((0, 0), (ug, ub));
        let v = factor((ug, ub), (groups - ug, bytes - ub));
        return Ok(Delta::LowRank(LowRank { u, v, factors: f }));
    }
    if let Some(bits) = cfg.wire.quantized_bits() {
        let (codes, scale) = (next(), next());
        let stride = Stride::of(cfg, round);
        let (groups, bytes) = quantized_sizes(stride.len(numel), bits);
        check_codes(&codes, &scale, groups, bytes, &format!("({bits}-bit)"))?;
        return Ok(Delta::Quantized(Quantized {
            codes,
            scale,
            bits,
            stride,
        }));
    }
    let c = Chunking::of(numel, cfg).expect("split tensors are longer than a chunk");
    let (idx, codes, scale) = (next(), next(), next());
    let want = (c.entries(), c.code_bytes(), 2 * c.chunks());
    if idx.kind() != Kind::Int16
        || idx.size() != [want.0]
        || codes.kind() != Kind::Uint8
        || codes.size() != [want.1]
        || scale.kind() != Kind::BFloat16
        || scale.size() != [want.2]
    {
        return Err(format!(
            "expected {} int16 indices, {} uint8 codes and {} bf16 scales, got {:?} {:?}, {:?} {:?} and {:?} {:?}",
            want.0, want.1, want.2,
            idx.kind(), idx.size(), codes.kind(), codes.size(), scale.kind(), scale.size()
        ));
    }
    let s = Sparse {
        idx,
        codes,
        scale,
        chunking: c,
        decoded: Default::default(),
    };
    s.check()?;
    Ok(Delta::Sparse(s))
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

/// Sparse deltas (`sync.wire = "sparse_delta"`), SparseLoCo's form: a tensor's change cut in
/// chunks of `sync.sparse_chunk` values ([`Chunking`]); each chunk sends its `sync.sparse_k`
/// entries of largest magnitude as an int16 index within the chunk and a 2-bit code — sign,
/// and whether the magnitude is the chunk's high or low level — with the two levels as bf16
/// (the mean magnitude of the sent entries above and below their mean). A level's bf16 value
/// is exact in fp32, so applying is an `index_add_` of unique indices, one correctly rounded
/// addition per entry, and the model stays bit-identical everywhere.
#[derive(Debug)]
pub struct Sparse {
    /// Per sent entry, its index within its chunk (int16), chunk after chunk; unique within a
    /// chunk.
    pub idx: Tensor,
    /// 2-bit codes (bit 0: negative; bit 1: high level), four to a byte, first in the lowest
    /// bits.
    pub codes: Tensor,
    /// Per chunk, its low and high magnitude (bf16), `[2 · chunks]`.
    pub scale: Tensor,
    pub chunking: Chunking,
    /// Per entry its flat index and value, on the parts' device, decoded once: a server
    /// measures an upload's norm and then folds it.
    decoded: std::cell::OnceCell<(Tensor, Tensor)>,
}

/// How the sparse wire cuts a tensor of `numel` values: whole chunks of `chunk` values, then a
/// shorter tail; a whole chunk sends `k` entries, the tail ⌈k · tail / chunk⌉.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunking {
    pub numel: i64,
    pub chunk: i64,
    pub k: i64,
}

impl Chunking {
    /// The cut of a tensor of `numel` values under `cfg`; `None` for a tensor of at most one
    /// chunk (norms, biases, a small router), which travels whole in bf16: a few bytes, and
    /// no one value of it waits for its turn.
    pub fn of(numel: i64, cfg: &SyncConfig) -> Option<Chunking> {
        (numel > cfg.sparse_chunk).then_some(Chunking {
            numel,
            chunk: cfg.sparse_chunk,
            k: cfg.sparse_k,
        })
    }

    fn whole_chunks(&self) -> i64 {
        self.numel / self.chunk
    }

    fn tail(&self) -> i64 {
        self.numel % self.chunk
    }

    fn tail_k(&self) -> i64 {
        match self.tail() {
            0 => 0,
            t => ((self.k * t + self.chunk - 1) / self.chunk).clamp(1, t),
        }
    }

    /// Chunks, the tail included.
    pub fn chunks(&self) -> i64 {
        self.whole_chunks() + i64::from(self.tail() > 0)
    }

    /// Entries sent.
    pub fn entries(&self) -> i64 {
        self.whole_chunks() * self.k + self.tail_k()
    }

    /// Bytes of packed codes.
    pub fn code_bytes(&self) -> i64 {
        (self.entries() + 3) / 4
    }

    /// Bytes on the wire: indices, codes and levels.
    pub fn bytes(&self) -> i64 {
        2 * self.entries() + self.code_bytes() + 4 * self.chunks()
    }

    /// Each sent entry's chunk (int64).
    fn rows(&self, dev: tch::Device) -> Tensor {
        Tensor::arange(self.entries(), (Kind::Int64, dev))
            .floor_divide_scalar(self.k)
            .clamp_max(self.whole_chunks())
    }
}

impl Sparse {
    /// The codes unpacked, one per entry (int64, 0..4).
    fn unpacked(&self, dev: tch::Device) -> Tensor {
        let bytes = Tensor::arange(256, (Kind::Int64, dev));
        let shifts = Tensor::arange(4, (Kind::Int64, dev)) * 2;
        let table = bytes
            .unsqueeze(1)
            .bitwise_right_shift(&shifts)
            .bitwise_and(3);
        table
            .index_select(0, &self.codes.to_device(dev).to_kind(Kind::Int64))
            .view([-1])
            .narrow(0, 0, self.chunking.entries())
    }

    /// Each sent entry's index in the flattened tensor (int64) and value (fp32, exact), on
    /// `dev`.
    pub fn entries_on(&self, dev: tch::Device) -> (Tensor, Tensor) {
        let decode = |dev| {
            tch::no_grad(|| {
                let rows = self.chunking.rows(dev);
                let flat =
                    &rows * self.chunking.chunk + self.idx.to_device(dev).to_kind(Kind::Int64);
                // Per chunk the four values a code can mean: +low, −low, +high, −high.
                let level = self.scale.to_device(dev).to_kind(Kind::Float).view([-1, 2]);
                let (lo, hi) = (level.select(1, 0), level.select(1, 1));
                let table = Tensor::stack(&[&lo, &-&lo, &hi, &-&hi], 1).view([-1]);
                let values = table.index_select(0, &(rows * 4 + self.unpacked(dev)));
                (flat, values)
            })
        };
        if dev != self.idx.device() {
            return decode(dev);
        }
        let (flat, values) = self.decoded.get_or_init(|| decode(dev));
        (flat.shallow_clone(), values.shallow_clone())
    }

    /// In place: `base ← base + sign · f32(self)`.
    fn add_into(&self, base: &Tensor, sign: f64) {
        tch::no_grad(|| {
            let (flat, values) = self.entries_on(base.device());
            // A new tensor, never the cached values scaled in place.
            let values = if sign == 1.0 { values } else { &values * sign };
            let _ = base.view([-1]).index_add_(0, &flat, &values);
        })
    }

    /// Indices in range and unique within each chunk, levels not negative.
    fn check(&self) -> Result<(), String> {
        let c = self.chunking;
        let idx = self.idx.to_kind(Kind::Int64);
        let body = c.whole_chunks() * c.k;
        let rows = [
            (idx.narrow(0, 0, body).view([-1, c.k.max(1)]), c.chunk),
            (idx.narrow(0, body, c.tail_k()).view([1, -1]), c.tail()),
        ];
        for (r, len) in rows {
            if r.numel() == 0 {
                continue;
            }
            let (sorted, _) = r.sort(1, false);
            let lo = sorted.min().int64_value(&[]);
            let hi = sorted.max().int64_value(&[]);
            let unique = sorted.size()[1] == 1
                || bool::try_from(
                    sorted
                        .diff(1, 1, None::<Tensor>, None::<Tensor>)
                        .gt(0)
                        .all(),
                )
                .unwrap_or(false);
            if lo < 0 || hi >= len || !unique {
                return Err(format!(
                    "indices must be unique within each chunk and in 0..{len}"
                ));
            }
        }
        if self.scale.min().double_value(&[]) < 0.0 {
            return Err("has a negative level".into());
        }
        Ok(())
    }

    /// Every part through `f` (a shallow copy, a deep one, a move to a device).
    fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Sparse {
        Sparse {
            idx: f(&self.idx),
            codes: f(&self.codes),
            scale: f(&self.scale),
            chunking: self.chunking,
            decoded: Default::default(),
        }
    }
}

/// The parts a compressed delta of one tensor travels as, each under `<tensor>#<suffix>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WirePart {
    /// Sparse: indices within their chunk (int16).
    Idx,
    /// Packed codes (uint8); low rank: U's, then V's.
    Codes,
    /// Quantized: one bf16 scale per group; sparse: two levels per chunk; low rank: U's, then
    /// V's, one per group.
    Scale,
    /// An expert's change its previous owner had not sent when the expert passed to another
    /// node, handed over whole in bf16 in that node's next upload (not a part of a delta).
    Handover,
}

impl WirePart {
    const ALL: [WirePart; 4] = [
        WirePart::Idx,
        WirePart::Codes,
        WirePart::Scale,
        WirePart::Handover,
    ];

    fn suffix(self) -> &'static str {
        match self {
            WirePart::Idx => "#idx",
            WirePart::Codes => "#q",
            WirePart::Scale => "#scale",
            WirePart::Handover => "#handover",
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

/// The sparse form of `v` (fp32): each chunk's `k` entries of largest magnitude, at two levels.
fn top_k(v: &Tensor, c: Chunking) -> Sparse {
    tch::no_grad(|| {
        let flat = v.reshape([-1]);
        let body = c.whole_chunks() * c.chunk;
        let mut pieces = vec![(flat.narrow(0, 0, body).view([-1, c.chunk]), c.k)];
        if c.tail() > 0 {
            pieces.push((flat.narrow(0, body, c.tail()).view([1, -1]), c.tail_k()));
        }
        let (mut idx, mut codes, mut levels) = (Vec::new(), Vec::new(), Vec::new());
        for (rows, k) in pieces {
            let (_, i) = rows.abs().topk(k, 1, true, false);
            let (code, level) = two_levels(&rows.gather(1, &i, false));
            idx.push(i.view([-1]));
            codes.push(code.view([-1]));
            levels.push(level.view([-1]));
        }
        let codes = Tensor::cat(&codes, 0);
        let padded = codes.constant_pad_nd([0, 4 * c.code_bytes() - c.entries()]);
        let per = padded.view([-1, 4]);
        let mut packed = per.select(1, 0).copy();
        for j in 1..4 {
            packed += per.select(1, j) * (1i64 << (2 * j));
        }
        Sparse {
            idx: Tensor::cat(&idx, 0).to_kind(Kind::Int16),
            codes: packed.to_kind(Kind::Uint8),
            scale: Tensor::cat(&levels, 0).to_kind(Kind::BFloat16),
            chunking: c,
            decoded: Default::default(),
        }
    })
}

/// Per row of `v` (fp32), each value's 2-bit code (int64) and the row's low and high levels
/// (fp32, `[rows, 2]`): the mean magnitude of the values at most and above the row's mean
/// magnitude, a one-step two-means split.
fn two_levels(v: &Tensor) -> (Tensor, Tensor) {
    let m = v.abs();
    let n = m.size()[1] as f64;
    let high = m.gt_tensor(&m.mean_dim(1, true, Kind::Float));
    let hf = high.to_kind(Kind::Float);
    let n_hi = hf.sum_dim_intlist(1, true, Kind::Float);
    let sum_hi = (&m * &hf).sum_dim_intlist(1, true, Kind::Float);
    let sum = m.sum_dim_intlist(1, true, Kind::Float);
    let hi = &sum_hi / n_hi.clamp_min(1.0);
    let lo = (&sum - &sum_hi) / (-&n_hi + n).clamp_min(1.0);
    // Rounded before coding, so a code means exactly the level the receiver decodes.
    let level = Tensor::cat(&[lo, hi], 1)
        .to_kind(Kind::BFloat16)
        .to_kind(Kind::Float);
    let code = v.lt(0.0).to_kind(Kind::Int64) + high.to_kind(Kind::Int64) * 2;
    (code, level)
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
    /// Which values of the flattened tensor the codes are for.
    pub stride: Stride,
}

/// The values of a flattened tensor a quantized delta of one round covers: those at
/// `offset, offset + step, …`. With `sync.stride = F`, round r sends the values at
/// `r mod F` modulo F — every value every F rounds, each round a 1/F slice of every tensor, so
/// the link carries the same load every round (Streaming DiLoCo's idea at value grain).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stride {
    pub offset: i64,
    pub step: i64,
}

impl Stride {
    /// Every value.
    pub const ALL: Stride = Stride { offset: 0, step: 1 };

    /// Round `round`'s stride under `cfg.stride`.
    pub fn of(cfg: &SyncConfig, round: u64) -> Stride {
        let step = cfg.stride.max(1) as i64;
        Stride {
            offset: (round % step as u64) as i64,
            step,
        }
    }

    /// How many of `numel` values it covers.
    pub fn len(&self, numel: i64) -> i64 {
        (numel - self.offset + self.step - 1).max(0) / self.step
    }

    /// The covered values of `flat` (`numel` long), a view sharing its storage.
    pub fn pick(&self, flat: &Tensor, numel: i64) -> Tensor {
        if *self == Stride::ALL {
            return flat.shallow_clone();
        }
        flat.slice(0, self.offset, numel, self.step)
    }
}

/// Low-rank deltas (`sync.wire = "lowrank_delta"`): a matrix's change `M` (m × n) as `U·Vᵀ` of
/// rank r (`sync.rank`, at most min(m, n)), each factor transposed, flattened and quantized to
/// [`FACTOR_BITS`] in groups of [`GROUP`] values ([`quantize`]). A round's change of a weight
/// matrix is close to low rank (docs/results/sync-cost.md): rank 16 in 4-bit codes carries
/// about 80 % of it in 1/60 of its fp32 bytes for a 256 × 256 matrix and 1/120 for an
/// 8192 × 256 one; what it leaves out is carried over (error feedback) as on the other lossy
/// wires.
///
/// Decoding is exact (a code times a bf16 scale) and the product is formed the same way on
/// every device, one rank at a time: `Σ_j u_j ⊗ v_j` as r outer products added in order, each
/// a correctly rounded fp32 multiplication or addition, never a matrix multiply (whose order of
/// additions and fused multiply-adds differ by library and device). So the server and every
/// node still hold bit-identical models.
#[derive(Debug)]
pub struct LowRank {
    /// Uᵀ (`[r, m]`, flattened), quantized.
    pub u: Quantized,
    /// Vᵀ (`[r, n]`, flattened), quantized.
    pub v: Quantized,
    pub factors: Factors,
}

/// The shape of a matrix's low-rank form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Factors {
    pub rows: i64,
    pub cols: i64,
    pub rank: i64,
}

/// Bits per code of a low-rank factor.
pub const FACTOR_BITS: u8 = 4;

/// Extra directions the range finder tracks beyond the rank, and its power iterations: with
/// both, its factors are as good as a truncated SVD's for a change whose spectrum decays.
const OVERSAMPLE: i64 = 4;
const POWER_ITERATIONS: usize = 2;

impl Factors {
    /// How the low-rank wire sends a tensor of `shape` under `cfg`: `None` for one that
    /// travels whole in bf16 (not a matrix, or its factors would not take under half its bf16
    /// bytes: norms, biases, small routers).
    pub fn of(shape: &[i64], cfg: &SyncConfig) -> Option<Factors> {
        let &[rows, cols] = shape else {
            return None;
        };
        let f = Factors {
            rows,
            cols,
            rank: cfg.rank.min(rows).min(cols),
        };
        (f.rank >= 1 && f.bytes() <= rows * cols).then_some(f)
    }

    /// Scales and code bytes of both factors together (U's, then V's).
    pub fn sizes(&self) -> (i64, i64) {
        let (ug, ub) = quantized_sizes(self.rank * self.rows, FACTOR_BITS);
        let (vg, vb) = quantized_sizes(self.rank * self.cols, FACTOR_BITS);
        (ug + vg, ub + vb)
    }

    /// Bytes on the wire: both factors' codes and scales.
    pub fn bytes(&self) -> i64 {
        let (groups, bytes) = self.sizes();
        bytes + 2 * groups
    }
}

/// A fixed pseudo-random `[n, k]` matrix of values in [−½, ½) from an integer hash of each
/// position: the range finder's start, the same every time and without touching libtorch's
/// global generator (which seeded model initialisation shares).
fn sketch(n: i64, k: i64, device: tch::Device) -> Tensor {
    let mask = 0xFFFF_FFFFi64;
    let mix = |h: Tensor| {
        let h = h.bitwise_xor_tensor(&h.bitwise_right_shift_tensor_scalar(16));
        (h * 0x045d_9f3bi64).bitwise_and(mask)
    };
    let i = Tensor::arange(n * k, (Kind::Int64, device));
    let h = (i * 2_654_435_761i64).bitwise_and(mask);
    let h = mix(mix(h));
    let h = h.bitwise_xor_tensor(&h.bitwise_right_shift_tensor_scalar(16));
    (h.to_kind(Kind::Float) / 4_294_967_296.0 - 0.5).view([n, k])
}

/// The rank-`f.rank` form of `change` (fp32, `f.rows × f.cols` values): a randomized range
/// finder with power iterations, then an SVD of the small projected matrix; the singular
/// values are split evenly between the factors before they are quantized.
fn low_rank(change: &Tensor, f: Factors) -> LowRank {
    tch::no_grad(|| {
        let m = change.reshape([f.rows, f.cols]).to_kind(Kind::Float);
        let k = (f.rank + OVERSAMPLE).min(f.rows).min(f.cols);
        let orth = |y: &Tensor| Tensor::linalg_qr(y, "reduced").0;
        let mut y = m.matmul(&sketch(f.cols, k, m.device()));
        for _ in 0..POWER_ITERATIONS {
            let z = orth(&m.tr().matmul(&orth(&y)));
            y = m.matmul(&z);
        }
        let q = orth(&y);
        let (ub, s, vb) = q.tr().matmul(&m).svd(true, true);
        let root = s.narrow(0, 0, f.rank).sqrt();
        let u = q.matmul(&ub.narrow(1, 0, f.rank)) * &root;
        let v = vb.narrow(1, 0, f.rank) * &root;
        LowRank {
            u: quantize(&u.tr().contiguous(), FACTOR_BITS),
            v: quantize(&v.tr().contiguous(), FACTOR_BITS),
            factors: f,
        }
    })
}

impl LowRank {
    /// Uᵀ and Vᵀ decoded on `dev` (exact), `[r, m]` and `[r, n]`.
    fn decoded(&self, dev: tch::Device) -> (Tensor, Tensor) {
        let f = self.factors;
        let u = self
            .u
            .on(dev)
            .dequantize(f.rank * f.rows)
            .view([f.rank, f.rows]);
        let v = self
            .v
            .on(dev)
            .dequantize(f.rank * f.cols)
            .view([f.rank, f.cols]);
        (u, v)
    }

    /// `U·Vᵀ` (fp32, `[m, n]`) on `dev`, formed the same way on every device (see [`LowRank`];
    /// on CPU, [`Delta::apply_`] computes the same in one pass).
    fn product(&self, dev: tch::Device) -> Tensor {
        tch::no_grad(|| {
            let (u, v) = self.decoded(dev);
            let term = |j: i64| u.get(j).unsqueeze(1) * v.get(j).unsqueeze(0);
            let mut out = term(0);
            for j in 1..self.factors.rank {
                out += term(j);
            }
            out
        })
    }

    /// `‖U·Vᵀ‖` (fp32 scalar) from the factors alone: √Σ (UᵀU ⊙ VᵀV).
    pub fn norm(&self) -> Tensor {
        tch::no_grad(|| {
            let (u, v) = self.decoded(self.u.codes.device());
            (u.matmul(&u.tr()) * v.matmul(&v.tr()))
                .sum(Kind::Float)
                .clamp_min(0.0)
                .sqrt()
        })
    }

    fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> LowRank {
        LowRank {
            u: self.u.map(&f),
            v: self.v.map(&f),
            factors: self.factors,
        }
    }
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
            stride: Stride::ALL,
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
            stride: self.stride,
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
            Wire::LowrankDelta,
            Wire::Bf16Delta,
        ] {
            let cfg = SyncConfig {
                wire,
                ..small_chunks()
            };
            let c = Delta::of_change(&v, &cfg, 1);
            assert_eq!(matches!(c, Delta::LowRank(_)), wire == Wire::LowrankDelta);
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
        for wire in [
            Wire::Int8Delta,
            Wire::SparseDelta,
            Wire::LowrankDelta,
            Wire::Bf16Delta,
        ] {
            let cfg = SyncConfig {
                wire,
                ..small_chunks()
            };
            let named = Delta::of_change(&v, &cfg, 1).into_wire("w");
            let shapes: Vec<(String, Vec<i64>, Kind)> = named
                .iter()
                .map(|(n, t)| (n.clone(), t.size(), t.kind()))
                .collect();
            assert_eq!(
                shapes,
                wire_entries(&cfg, "w", &shape, 1, false),
                "{wire:?}"
            );
            let back = decode(named, &cfg, 1, shape_of).unwrap();
            assert_eq!(back.len(), 1);
            let want = Delta::of_change(&v, &cfg, 1).to_f32(&v);
            assert!(back[0].1.to_f32(&v).equal(&want), "{wire:?}");
            let mut twice = Delta::of_change(&v, &cfg, 1).into_wire("w");
            twice.extend(Delta::of_change(&v, &cfg, 1).into_wire("w"));
            assert!(decode(twice, &cfg, 1, shape_of)
                .unwrap_err()
                .contains("twice"));
            let stray = Delta::of_change(&v, &cfg, 1).into_wire("x");
            let e = decode(stray, &cfg, 1, shape_of).unwrap_err();
            assert!(e.contains("unknown tensor `x`"), "{e}");
        }
        let cfg = SyncConfig {
            wire: Wire::Int4Delta,
            ..SyncConfig::default()
        };
        let mut half = Delta::of_change(&v, &cfg, 1).into_wire("w");
        half.pop();
        let e = decode(half, &cfg, 1, shape_of).unwrap_err();
        assert!(e.contains("lacks one of its #q, #scale parts"), "{e}");
        let e = decode(vec![("w".into(), v.copy())], &cfg, 1, shape_of).unwrap_err();
        assert!(e.contains("expected a bf16 delta"), "{e}");
        // A lossy wire also takes a tensor whole in bf16 (a run's last round), not both ways.
        let whole = vec![("w".to_owned(), v.to_kind(Kind::BFloat16))];
        assert!(matches!(
            decode(whole, &cfg, 1, shape_of).unwrap()[0].1,
            Delta::Dense(_)
        ));
        let mut both = Delta::of_change(&v, &cfg, 1).into_wire("w");
        both.push(("w".into(), v.to_kind(Kind::BFloat16)));
        let e = decode(both, &cfg, 1, shape_of).unwrap_err();
        assert!(e.contains("both whole and in parts"), "{e}");
    }

    /// The sparse wire with chunks of 64 values, 8 sent each: 1000 values are 15 chunks and a
    /// tail of 40 (5 sent).
    fn small_chunks() -> SyncConfig {
        SyncConfig {
            wire: Wire::SparseDelta,
            sparse_chunk: 64,
            sparse_k: 8,
            ..SyncConfig::default()
        }
    }

    #[test]
    fn sparse_deltas_send_each_chunks_largest_entries_at_two_levels() {
        let v = sample();
        let cfg = small_chunks();
        let Delta::Sparse(s) = Delta::of_change(&v, &cfg, 1) else {
            panic!("1000 values are more than a chunk");
        };
        let c = s.chunking;
        assert_eq!(
            (c.chunks(), c.entries(), c.code_bytes()),
            (16, 15 * 8 + 5, 32)
        );
        let wire: Vec<(String, Vec<i64>, Kind)> = Delta::Sparse(s.map(Tensor::shallow_clone))
            .into_wire("w")
            .iter()
            .map(|(n, t)| (n.clone(), t.size(), t.kind()))
            .collect();
        assert_eq!(wire, wire_entries(&cfg, "w", &[10, 100], 1, false));
        let flat = v.reshape([-1]);
        let d = Delta::Sparse(s.map(Tensor::shallow_clone))
            .to_f32(&v)
            .reshape([-1]);
        let sent: Vec<i64> = Vec::try_from(s.entries_on(tch::Device::Cpu).0).unwrap();
        for chunk in 0..16i64 {
            let (start, len, k) = if chunk < 15 {
                (chunk * 64, 64, 8)
            } else {
                (960, 40, 5)
            };
            let mine: Vec<i64> = sent
                .iter()
                .copied()
                .filter(|i| (start..start + len).contains(i))
                .collect();
            assert_eq!(mine.len(), k, "chunk {chunk}");
            // Every entry left out is no larger than the smallest sent one.
            let part = flat.narrow(0, start, len).abs();
            let picked = Tensor::from_slice(&mine) - start;
            let smallest = part.index_select(0, &picked).min().double_value(&[]);
            let nonzero = d
                .narrow(0, start, len)
                .ne(0.0)
                .sum(Kind::Int64)
                .int64_value(&[]);
            assert!(nonzero <= k as i64);
            let kth = part.topk(k as i64, 0, true, true).0.min().double_value(&[]);
            assert_eq!(smallest, kth, "chunk {chunk}");
        }
        // Sent entries keep their sign and take one of their chunk's two levels.
        let at = s.entries_on(tch::Device::Cpu).0;
        let signs = d
            .index_select(0, &at)
            .sign()
            .eq_tensor(&flat.index_select(0, &at).sign());
        let zero_chunk = flat.index_select(0, &at).eq(0.0);
        assert!(bool::try_from(signs.logical_or(&zero_chunk).all()).unwrap());
        let levels = s.scale.to_kind(Kind::Float).view([-1, 2]);
        assert!(bool::try_from(levels.select(1, 0).le_tensor(&levels.select(1, 1)).all()).unwrap());
    }

    #[test]
    fn sparse_wire_sends_tensors_of_one_chunk_whole_and_refuses_bad_indices() {
        let cfg = small_chunks();
        let small = Tensor::ones([64], (Kind::Float, tch::Device::Cpu));
        assert!(matches!(Delta::of_change(&small, &cfg, 1), Delta::Dense(_)));
        assert_eq!(
            wire_entries(&cfg, "n", &[64], 1, false),
            vec![("n".into(), vec![64], Kind::BFloat16)]
        );
        let v = sample();
        let shape = [10i64, 100];
        let shape_of = |n: &str| (n == "w").then_some(&shape[..]);
        let parts = |f: &dyn Fn(&mut Tensor)| {
            let mut w = Delta::of_change(&v, &cfg, 1).into_wire("w");
            f(&mut w[0].1);
            decode(w, &cfg, 1, shape_of)
        };
        assert!(parts(&|_| ()).is_ok());
        let e = parts(&|i| {
            let first = i.int64_value(&[0]);
            let _ = i.get(1).fill_(first);
        })
        .unwrap_err();
        assert!(e.contains("unique within each chunk"), "{e}");
        // The tail is 40 values long.
        let e = parts(&|i| {
            let _ = i.get(i.size()[0] - 1).fill_(40);
        })
        .unwrap_err();
        assert!(e.contains("in 0..40"), "{e}");
        let tiny = [64i64];
        let e = decode(
            Delta::of_change(&v, &cfg, 1).into_wire("n"),
            &cfg,
            1,
            |n: &str| (n == "n").then_some(&tiny[..]),
        )
        .unwrap_err();
        assert!(e.contains("travels whole in bf16"), "{e}");
    }
    #[test]
    fn a_low_rank_delta_carries_a_low_rank_change_and_applies_as_its_product() {
        tch::manual_seed(11);
        let dev = tch::Device::Cpu;
        // Rank 3 plus a little noise, in a 96 × 80 matrix.
        let a = Tensor::randn([96, 3], (Kind::Float, dev));
        let b = Tensor::randn([3, 80], (Kind::Float, dev));
        let change = (a.matmul(&b) + Tensor::randn([96, 80], (Kind::Float, dev)) * 0.01) * 1e-3;
        let cfg = SyncConfig {
            wire: Wire::LowrankDelta,
            rank: 4,
            ..SyncConfig::default()
        };
        let Delta::LowRank(l) = Delta::of_change(&change, &cfg, 1) else {
            panic!("a 96 × 80 matrix travels in factors");
        };
        assert_eq!(
            l.factors,
            Factors {
                rows: 96,
                cols: 80,
                rank: 4
            }
        );
        let d = Delta::LowRank(l);
        let approx = d.to_f32(&change);
        // 4-bit factors: each entry within half a step of its group's largest / 7.
        let rel = (&approx - &change).norm().double_value(&[]) / change.norm().double_value(&[]);
        assert!(rel < 0.2, "relative error {rel}");
        // The product is r outer products added in order, and apply_ adds exactly it.
        let Delta::LowRank(l) = &d else {
            unreachable!()
        };
        let (u, v) = l.decoded(dev);
        let mut want = u.get(0).outer(&v.get(0));
        for j in 1..4 {
            want += u.get(j).outer(&v.get(j));
        }
        assert!(approx.equal(&want));
        let base = Tensor::randn([96, 80], (Kind::Float, dev));
        let mut applied = base.copy();
        d.apply_(&mut applied);
        assert!(applied.equal(&(&base + &want)));
        // The server's fold forms the same sum through BLAS: equal up to fp32 rounding.
        let mut folded = base.copy();
        d.fold_into(&mut folded);
        let off = (&folded - &applied).abs().max().double_value(&[]);
        assert!(
            off <= 1e-6 * base.abs().max().double_value(&[]),
            "fold off by {off}"
        );
        assert!(d.folded_f32(&change).allclose(&want, 1e-5, 1e-9, false));
        let (n, m) = (d.norm().double_value(&[]), want.norm().double_value(&[]));
        assert!((n - m).abs() <= 1e-4 * m, "norm {n} vs {m}");
        // Quantized factors: a code times a bf16 scale, exact in fp32.
        assert_eq!(l.u.bits, FACTOR_BITS);
    }

    #[test]
    fn the_low_rank_wire_sends_matrices_in_factors_and_the_rest_whole() {
        let cfg = SyncConfig {
            wire: Wire::LowrankDelta,
            rank: 8,
            ..SyncConfig::default()
        };
        // Norms and other vectors travel whole; so do matrices too small to gain.
        assert_eq!(Factors::of(&[256], &cfg), None);
        assert_eq!(Factors::of(&[8, 8], &cfg), None);
        // The rank never exceeds a side.
        assert_eq!(Factors::of(&[4, 4096], &cfg).map(|f| f.rank), Some(4));
        let f = Factors::of(&[256, 256], &cfg).unwrap();
        // 8 · (256 + 256) 4-bit codes and their scales: 1/128 of the fp32 bytes and a little.
        assert_eq!(f.bytes(), 2 * 1024 + 2 * 2 * 32);
        let entries = wire_entries(&cfg, "w", &[256, 256], 3, false);
        let names: Vec<&str> = entries.iter().map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(names, ["w#q", "w#scale"]);
        assert_eq!(
            wire_entries(&cfg, "w", &[256, 256], 3, true),
            vec![("w".to_owned(), vec![256, 256], Kind::BFloat16)]
        );
        // A tensor that travels whole is refused in parts, and bad sizes are named.
        let shape = [8i64, 8];
        let big = [64i64, 64];
        let v = Tensor::randn([64, 64], (Kind::Float, tch::Device::Cpu));
        let cfg4 = SyncConfig { rank: 4, ..cfg };
        let wire = Delta::of_change(&v, &cfg4, 1).into_wire("w");
        let e = decode(wire, &cfg4, 1, |_| Some(&shape[..])).unwrap_err();
        assert!(e.contains("travels whole in bf16"), "{e}");
        let mut wire = Delta::of_change(&v, &cfg4, 1).into_wire("w");
        wire[0].1 = wire[0].1.narrow(0, 0, 10);
        let e = decode(wire, &cfg4, 1, |_| Some(&big[..])).unwrap_err();
        assert!(e.contains("rank-4 factors"), "{e}");
    }
}
