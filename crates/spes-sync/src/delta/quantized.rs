//! The quantized codec (`sync.wire = "int8_delta" | "int4_delta" | "int2_delta"`): codes and a
//! scale per group, optionally over a strided slice of the values.

use crate::config::SyncConfig;
use tch::{Kind, Tensor};

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
    pub(super) fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Quantized {
        Quantized {
            codes: f(&self.codes),
            scale: f(&self.scale),
            bits: self.bits,
            stride: self.stride,
        }
    }

    /// A copy on `device`: codes travel to a GPU at 1/16 of the bytes of the fp32 values they
    /// decode to there.
    pub(super) fn on(&self, device: tch::Device) -> Quantized {
        self.map(|t| t.to_device(device))
    }
}
