//! Decode-and-add of a compressed delta in one pass over CPU memory, where libtorch's path
//! writes intermediate tensors and adds them in several passes: a quantized delta's
//! `target += code · scale` byte by byte, and a low-rank delta's `target += Σ_j u_j ⊗ v_j` row by
//! row. Each value goes through the same fp32 operations in the same order as the tensor path
//! of [`crate::delta::Delta::apply_`] (which other devices keep), so the results are
//! bit-identical.

use super::{Quantized, GROUP};
use tch::{Device, Kind, Tensor};

/// `flat[stride] += f32(q)` for a contiguous CPU fp32 `flat` of `numel` values; `false` (and
/// nothing done) when the tensors are not laid out for it.
pub(crate) fn add_quantized(flat: &Tensor, q: &Quantized, numel: i64) -> bool {
    let cpu = |t: &Tensor, kind| t.device() == Device::Cpu && t.kind() == kind && t.is_contiguous();
    if !(cpu(flat, Kind::Float) && cpu(&q.codes, Kind::Uint8) && cpu(&q.scale, Kind::BFloat16))
        || flat.numel() as i64 != numel
    {
        return false;
    }
    let bits = q.bits as usize;
    let per = 8 / bits;
    let half = 1i32 << (bits - 1);
    let mask = ((1u16 << bits) - 1) as u8;
    let len = q.stride.len(numel) as usize;
    let (offset, step) = (q.stride.offset as usize, q.stride.step as usize);
    let groups = q.scale.numel();
    let bytes_per_group = GROUP as usize / per;
    if q.codes.numel() != groups * bytes_per_group || groups * (GROUP as usize) < len {
        return false;
    }
    // Safety: the three tensors are contiguous CPU tensors of the kinds checked above, alive
    // for the call; `target` covers `numel` values, and every index below is < numel.
    let (target, codes, scale) = unsafe {
        (
            std::slice::from_raw_parts_mut(flat.data_ptr() as *mut f32, numel as usize),
            std::slice::from_raw_parts(q.codes.data_ptr() as *const u8, q.codes.numel()),
            std::slice::from_raw_parts(q.scale.data_ptr() as *const u16, groups),
        )
    };
    // Per group, what each code means: (code − half) · scale, an exact product.
    let mut level = vec![0f32; 1 << bits];
    for (g, &s) in scale.iter().enumerate() {
        let s = f32::from_bits((s as u32) << 16);
        let first = g * GROUP as usize;
        if first >= len {
            break;
        }
        // Eight bits have more levels than a group has values: scale each code instead.
        if bits == 8 {
            let n = (len - first).min(GROUP as usize);
            let group = &codes[g * bytes_per_group..(g + 1) * bytes_per_group];
            for (i, &c) in group.iter().take(n).enumerate() {
                target[offset + (first + i) * step] += (c as i32 - half) as f32 * s;
            }
            continue;
        }
        for (c, l) in level.iter_mut().enumerate() {
            *l = (c as i32 - half) as f32 * s;
        }
        let n = (len - first).min(GROUP as usize);
        let group = &codes[g * bytes_per_group..(g + 1) * bytes_per_group];
        if step == 1 && n == GROUP as usize {
            // A whole group in place, unrolled by byte: the common case.
            let out = &mut target[offset + first..offset + first + n];
            for (o, &b) in out.chunks_exact_mut(per).zip(group) {
                for (t, x) in o.iter_mut().enumerate() {
                    *x += level[((b >> (bits * t)) & mask) as usize];
                }
            }
            continue;
        }
        for i in 0..n {
            let c = (group[i / per] >> (bits * (i % per))) & mask;
            target[offset + (first + i) * step] += level[c as usize];
        }
    }
    true
}

/// `target += Σ_j uᵀ[j] ⊗ vᵀ[j]` for a contiguous CPU fp32 `target` of `[rows, cols]` values,
/// with the decoded factors `u` (`[rank, rows]`) and `v` (`[rank, cols]`), fp32: per value the
/// first product, then each next product added in order, then the sum added to the target,
/// each a single fp32 operation (Rust never fuses a multiply and an add). `false` (and nothing
/// done) when the tensors are not laid out for it.
pub(crate) fn add_low_rank(target: &Tensor, u: &Tensor, v: &Tensor) -> bool {
    let cpu =
        |t: &Tensor| t.device() == Device::Cpu && t.kind() == Kind::Float && t.is_contiguous();
    let (Ok((rank, rows)), Ok((r2, cols))) = (u.size2(), v.size2()) else {
        return false;
    };
    if !(cpu(target) && cpu(u) && cpu(v)) || rank != r2 || rank < 1 {
        return false;
    }
    let (rank, rows, cols) = (rank as usize, rows as usize, cols as usize);
    if target.numel() != rows * cols {
        return false;
    }
    // Safety: contiguous CPU fp32 tensors of the sizes checked above, alive for the call.
    let (target, u, v) = unsafe {
        (
            std::slice::from_raw_parts_mut(target.data_ptr() as *mut f32, rows * cols),
            std::slice::from_raw_parts(u.data_ptr() as *const f32, rank * rows),
            std::slice::from_raw_parts(v.data_ptr() as *const f32, rank * cols),
        )
    };
    // Rows are independent: large targets are cut into a block of rows per core.
    let threads = if rows * cols * rank < 1 << 22 {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    };
    let per = rows.div_ceil(threads);
    let f = Factors {
        rows,
        cols,
        rank,
        u,
        v,
    };
    std::thread::scope(|scope| {
        for (block, chunk) in target.chunks_mut(per * cols).enumerate() {
            scope.spawn(move || low_rank_rows(chunk, block * per, f));
        }
    });
    true
}

/// The decoded factors of [`add_low_rank`]: Uᵀ (`[rank, rows]`) and Vᵀ (`[rank, cols]`).
#[derive(Clone, Copy)]
struct Factors<'a> {
    rows: usize,
    cols: usize,
    rank: usize,
    u: &'a [f32],
    v: &'a [f32],
}

/// Rows `first..` of [`add_low_rank`] into `chunk`: with AVX2 where the CPU has it (8 lanes
/// instead of SSE2's 4; still one multiply and one add per step, so the same bits).
fn low_rank_rows(chunk: &mut [f32], first: usize, f: Factors) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // Safety: the CPU has AVX2, checked just above.
        return unsafe { low_rank_rows_avx2(chunk, first, f) };
    }
    low_rank_rows_any(chunk, first, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn low_rank_rows_avx2(chunk: &mut [f32], first: usize, f: Factors) {
    low_rank_rows_any(chunk, first, f)
}

#[inline(always)]
fn low_rank_rows_any(chunk: &mut [f32], first: usize, f: Factors) {
    let Factors {
        rows,
        cols,
        rank,
        u,
        v,
    } = f;
    let mut acc = vec![0f32; cols];
    for (r, row) in chunk.chunks_exact_mut(cols).enumerate() {
        let i = first + r;
        let a = u[i];
        for (s, &b) in acc.iter_mut().zip(&v[..cols]) {
            *s = a * b;
        }
        for j in 1..rank {
            let a = u[j * rows + i];
            for (s, &b) in acc.iter_mut().zip(&v[j * cols..(j + 1) * cols]) {
                *s += a * b;
            }
        }
        for (t, &s) in row.iter_mut().zip(&acc) {
            *t += s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{SyncConfig, Wire};
    use crate::delta::Delta;

    #[test]
    fn one_pass_gives_the_tensor_paths_bits() {
        tch::manual_seed(19);
        let numel = 1000;
        let change = Tensor::randn([numel], (Kind::Float, Device::Cpu)) * 1e-3;
        let base = Tensor::randn([numel], (Kind::Float, Device::Cpu));
        for wire in [Wire::Int8Delta, Wire::Int4Delta, Wire::Int2Delta] {
            for stride in [1, 3] {
                let cfg = SyncConfig {
                    wire: wire.into(),
                    stride,
                    ..SyncConfig::default()
                };
                let Delta::Quantized(q) = Delta::of_change(&change, &cfg, 5) else {
                    panic!("a quantized wire");
                };
                let fused = base.copy();
                assert!(add_quantized(&fused, &q, numel));
                // The tensor path: decode, scale, add.
                let d = q.dequantize(q.stride.len(numel));
                let want = base.copy();
                let _ = q.stride.pick(&want, numel).g_add_(&d);
                assert!(fused.equal(&want), "{wire:?} stride {stride}");
                assert!(
                    !fused.equal(&base),
                    "{wire:?} stride {stride}: nothing added"
                );
            }
        }
    }

    #[test]
    fn one_pass_gives_the_low_rank_tensor_paths_bits() {
        tch::manual_seed(23);
        // Large enough to be cut into blocks of rows, one per core.
        let (rank, rows, cols) = (5, 1031, 997);
        let u = Tensor::randn([rank, rows], (Kind::Float, Device::Cpu)) * 1e-2;
        let v = Tensor::randn([rank, cols], (Kind::Float, Device::Cpu)) * 1e-2;
        let base = Tensor::randn([rows, cols], (Kind::Float, Device::Cpu));
        let fused = base.copy();
        assert!(add_low_rank(&fused, &u, &v));
        // The tensor path: one outer product after another, then the sum into the target.
        let mut sum = u.get(0).outer(&v.get(0));
        for j in 1..rank {
            sum += u.get(j).outer(&v.get(j));
        }
        assert!(fused.equal(&(&base + &sum)));
        assert!(
            !add_low_rank(&fused, &u, &v.narrow(0, 0, 4)),
            "ranks differ"
        );
    }
}
