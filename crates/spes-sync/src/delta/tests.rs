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
            wire: wire.into(),
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
            wire: wire.into(),
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
        wire: Wire::Int4Delta.into(),
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
        wire: Wire::SparseDelta.into(),
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
        wire: Wire::LowrankDelta.into(),
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
        wire: Wire::LowrankDelta.into(),
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
