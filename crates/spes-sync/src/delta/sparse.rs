//! The sparse codec (`sync.wire = "sparse_delta"`): each chunk's largest entries at two levels.

use crate::config::SyncConfig;
use tch::{Kind, Tensor};

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
    /// A sparse delta from its parts (not checked: [`Sparse::check`]).
    pub(super) fn new(idx: Tensor, codes: Tensor, scale: Tensor, chunking: Chunking) -> Sparse {
        Sparse {
            idx,
            codes,
            scale,
            chunking,
            decoded: Default::default(),
        }
    }

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
    pub(super) fn add_into(&self, base: &Tensor, sign: f64) {
        tch::no_grad(|| {
            let (flat, values) = self.entries_on(base.device());
            // A new tensor, never the cached values scaled in place.
            let values = if sign == 1.0 { values } else { &values * sign };
            let _ = base.view([-1]).index_add_(0, &flat, &values);
        })
    }

    /// Indices in range and unique within each chunk, levels not negative.
    pub(super) fn check(&self) -> Result<(), String> {
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
    pub(super) fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> Sparse {
        Sparse {
            idx: f(&self.idx),
            codes: f(&self.codes),
            scale: f(&self.scale),
            chunking: self.chunking,
            decoded: Default::default(),
        }
    }
}

/// The sparse form of `v` (fp32): each chunk's `k` entries of largest magnitude, at two levels.
pub(super) fn top_k(v: &Tensor, c: Chunking) -> Sparse {
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
