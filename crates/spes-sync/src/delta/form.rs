//! The table of wire forms: how one tensor of a round travels under `sync.wire` — whole, or
//! in which parts of which kinds and lengths. The codecs encode into it ([`Delta::of_change`]),
//! [`decode`] checks every payload against it, and the planner and the payload bounds count
//! their bytes from it, so each form's sizes are written once.
//!
//! [`Delta::of_change`]: super::Delta::of_change
//! [`decode`]: super::decode

use super::lowrank::Factors;
use super::names::WirePart;
use super::quantized::{quantized_sizes, Stride};
use super::sparse::Chunking;
use crate::config::{SyncConfig, Wire};
use tch::Kind;

/// How one tensor travels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Form {
    /// One wire tensor under the tensor's own name and shape: the value in fp32 on the `fp32`
    /// wire, else the change whole in bf16 ([`super::Delta::whole`]).
    Whole(Kind),
    /// Each chunk's largest entries ([`super::Sparse`]).
    Sparse(Chunking),
    /// Codes and group scales of the values `stride` covers ([`super::Quantized`]).
    Quantized { bits: u8, stride: Stride },
    /// Two quantized factors ([`super::LowRank`]).
    LowRank(Factors),
}

impl Form {
    /// How a tensor of `shape` travels in round `round` of a run on `cfg.wire`; a run's `last`
    /// round sends every delta whole in bf16.
    pub fn of(cfg: &SyncConfig, shape: &[i64], round: u64, last: bool) -> Form {
        let bf16 = Form::Whole(Kind::BFloat16);
        if last && cfg.wire().is_delta() {
            return bf16;
        }
        match cfg.wire() {
            Wire::Fp32 => Form::Whole(Kind::Float),
            Wire::Bf16Delta => bf16,
            Wire::SparseDelta => {
                Chunking::of(shape.iter().product(), cfg).map_or(bf16, Form::Sparse)
            }
            Wire::LowrankDelta => Factors::of(shape, cfg).map_or(bf16, Form::LowRank),
            wire => Form::Quantized {
                bits: wire.quantized_bits().expect("a quantized wire"),
                stride: Stride::of(cfg, round),
            },
        }
    }

    /// Its parts for a tensor of `numel` values, in the order [`Form::parts_of`] lists them:
    /// each part, its length and its kind. None for a whole tensor.
    pub fn parts(&self, numel: i64) -> Vec<(WirePart, i64, Kind)> {
        let codes_and_scales = |(groups, bytes): (i64, i64)| {
            vec![
                (WirePart::Codes, bytes, Kind::Uint8),
                (WirePart::Scale, groups, Kind::BFloat16),
            ]
        };
        match *self {
            Form::Whole(_) => Vec::new(),
            Form::Sparse(c) => vec![
                (WirePart::Idx, c.entries(), Kind::Int16),
                (WirePart::Codes, c.code_bytes(), Kind::Uint8),
                (WirePart::Scale, 2 * c.chunks(), Kind::BFloat16),
            ],
            Form::Quantized { bits, stride } => {
                codes_and_scales(quantized_sizes(stride.len(numel), bits))
            }
            // U's codes then V's in one part, their scales likewise.
            Form::LowRank(f) => codes_and_scales(f.sizes()),
        }
    }

    /// The form in words, for errors: `rank-16 factors`, `4-bit codes`, `top-k of chunks`.
    pub fn describe(&self) -> String {
        match *self {
            Form::Whole(kind) => format!("{kind:?} whole"),
            Form::Sparse(c) => format!("top-{} of chunks of {}", c.k, c.chunk),
            Form::Quantized { bits, .. } => format!("{bits}-bit codes"),
            Form::LowRank(f) => format!("rank-{} factors", f.rank),
        }
    }

    /// The parts the split forms of `wire` send, in the order they are listed and decoded.
    pub fn parts_of(wire: Wire) -> &'static [WirePart] {
        match wire {
            Wire::SparseDelta => &[WirePart::Idx, WirePart::Codes, WirePart::Scale],
            w if w == Wire::LowrankDelta || w.quantized_bits().is_some() => {
                &[WirePart::Codes, WirePart::Scale]
            }
            _ => &[],
        }
    }

    /// The wire tensors (name, shape, kind) that carry tensor `name` of `shape` in this form.
    pub fn entries(&self, name: &str, shape: &[i64]) -> Vec<(String, Vec<i64>, Kind)> {
        match *self {
            Form::Whole(kind) => vec![(name.to_owned(), shape.to_vec(), kind)],
            _ => self
                .parts(shape.iter().product())
                .into_iter()
                .map(|(part, len, kind)| (part.name(name), vec![len], kind))
                .collect(),
        }
    }

    /// Bytes on the wire of a tensor of `shape` in this form.
    pub fn bytes(&self, shape: &[i64]) -> i64 {
        self.entries("", shape)
            .iter()
            .map(|(_, s, k)| s.iter().product::<i64>() * k.elt_size_in_bytes() as i64)
            .sum()
    }
}

/// The wire tensors (name, shape, kind) that carry tensor `name` of `shape` in round `round`
/// of `cfg.wire`: what an upload or a published round of it takes, exactly.
pub fn wire_entries(
    cfg: &SyncConfig,
    name: &str,
    shape: &[i64],
    round: u64,
    last: bool,
) -> Vec<(String, Vec<i64>, Kind)> {
    Form::of(cfg, shape, round, last).entries(name, shape)
}
