//! The low-rank codec (`sync.wire = "lowrank_delta"`): a matrix's change as two quantized
//! factors.

use super::quantized::{quantize, quantized_sizes, Quantized, Stride};
use crate::config::SyncConfig;
use tch::{Kind, Tensor};

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
pub(super) fn low_rank(change: &Tensor, f: Factors) -> LowRank {
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
    /// The factors from their wire parts: U's codes then V's in `codes`, their scales likewise
    /// in `scale` (sizes checked by the form table).
    pub(super) fn from_parts(codes: Tensor, scale: Tensor, f: Factors) -> LowRank {
        let (ug, ub) = quantized_sizes(f.rank * f.rows, FACTOR_BITS);
        let (groups, bytes) = f.sizes();
        let factor = |at: (i64, i64), len: (i64, i64)| Quantized {
            codes: codes.narrow(0, at.1, len.1),
            scale: scale.narrow(0, at.0, len.0),
            bits: FACTOR_BITS,
            stride: Stride::ALL,
        };
        LowRank {
            u: factor((0, 0), (ug, ub)),
            v: factor((ug, ub), (groups - ug, bytes - ub)),
            factors: f,
        }
    }

    /// Uᵀ and Vᵀ decoded on `dev` (exact), `[r, m]` and `[r, n]`.
    pub(super) fn decoded(&self, dev: tch::Device) -> (Tensor, Tensor) {
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
    pub(super) fn product(&self, dev: tch::Device) -> Tensor {
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

    pub(super) fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> LowRank {
        LowRank {
            u: self.u.map(&f),
            v: self.v.map(&f),
            factors: self.factors,
        }
    }
}
