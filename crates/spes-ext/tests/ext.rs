//! The shim's operations against plain tch arithmetic, and its error path.

use spes_ext::{
    add_lists, add_scalar, clip_grad_norm, clip_to_norm, fused_adamw, grouped_mm_trained_first,
    sq_norm, zero, AdamWGroup, AdamWHyper,
};
use tch::{Device, Kind, Tensor};

const FLOAT: (Kind, Device) = (Kind::Float, Device::Cpu);

const H: AdamWHyper = AdamWHyper {
    lr: 0.1,
    beta1: 0.9,
    beta2: 0.95,
    weight_decay: 0.1,
    eps: 1e-8,
};

#[test]
fn clipping_returns_the_norm_and_scales_only_above_the_max() {
    let grads = [
        Tensor::from_slice(&[3.0f32, 0.0]),
        Tensor::from_slice(&[4.0f32]),
    ];
    let total = clip_grad_norm(&grads, 1.0).unwrap();
    assert!((total.double_value(&[]) - 5.0).abs() < 1e-6);
    assert!((grads[0].double_value(&[0]) - 0.6).abs() < 1e-6);
    assert!((grads[1].double_value(&[0]) - 0.8).abs() < 1e-6);
    // Below the max: untouched (the coefficient is clamped to 1).
    let small = [Tensor::from_slice(&[0.3f32, 0.4])];
    let _ = clip_grad_norm(&small, 1.0).unwrap();
    assert_eq!(Vec::<f32>::try_from(&small[0]).unwrap(), vec![0.3, 0.4]);
    assert_eq!(clip_grad_norm(&[], 1.0).unwrap().double_value(&[]), 0.0);
}

/// A norm split into parts (as ranks that each own some gradients compute it) and clipping to
/// it give what clipping the whole list does.
#[test]
fn a_norm_in_parts_clips_as_the_whole_does() {
    let whole = [
        Tensor::from_slice(&[3.0f32, 0.0]),
        Tensor::from_slice(&[4.0f32]),
        Tensor::from_slice(&[12.0f32]),
    ];
    let parts = [whole[0].copy(), whole[1].copy(), whole[2].copy()];
    let total = clip_grad_norm(&whole, 2.0).unwrap();
    let a = sq_norm(&parts[..2]).unwrap().unwrap();
    let b = sq_norm(&parts[2..]).unwrap().unwrap();
    assert!((a.double_value(&[]) - 25.0).abs() < 1e-5);
    let norm = (a + b).sqrt();
    assert!((norm.double_value(&[]) - total.double_value(&[])).abs() < 1e-5);
    clip_to_norm(&parts[..2], &norm, 2.0).unwrap();
    clip_to_norm(&parts[2..], &norm, 2.0).unwrap();
    for (p, w) in parts.iter().zip(&whole) {
        assert_eq!(
            Vec::<f32>::try_from(p).unwrap(),
            Vec::<f32>::try_from(w).unwrap()
        );
    }
    assert!(sq_norm(&[]).unwrap().is_none());
    clip_to_norm(&[], &norm, 2.0).unwrap();
}

#[test]
fn zero_and_add_work_in_place_on_every_tensor() {
    let ts = [Tensor::ones([3], FLOAT), Tensor::ones([2, 2], FLOAT)];
    add_scalar(&ts, 2.0).unwrap();
    assert_eq!(ts[1].sum(Kind::Float).double_value(&[]), 12.0);
    zero(&ts).unwrap();
    assert!(ts
        .iter()
        .all(|t| t.abs().sum(Kind::Float).double_value(&[]) == 0.0));
}

/// One fused step from zero moments at step 1: bias correction makes the update
/// `-lr·sign(g)` (up to eps) after decay.
#[test]
fn fused_adamw_first_step_is_a_signed_lr_step() {
    let w = Tensor::from_slice(&[1.0f32, -2.0]);
    let g = Tensor::from_slice(&[0.5f32, -3.0]);
    let (m, v) = (w.zeros_like(), w.zeros_like());
    let steps = [Tensor::full([], 1.0, FLOAT)];
    let group = AdamWGroup {
        params: std::slice::from_ref(&w),
        grads: std::slice::from_ref(&g),
        exp_avgs: std::slice::from_ref(&m),
        exp_avg_sqs: std::slice::from_ref(&v),
        steps: &steps,
    };
    fused_adamw(&group, H).unwrap();
    let got = Vec::<f32>::try_from(&w).unwrap();
    let decay = 1.0 - 0.1 * 0.1;
    assert!((got[0] - (decay - 0.1)).abs() < 1e-6, "{got:?}");
    assert!((got[1] - (-2.0 * decay + 0.1)).abs() < 1e-6, "{got:?}");
    assert!((m.double_value(&[1]) - 0.1 * -3.0).abs() < 1e-6);
}

/// Bad input is an error naming the operation, never an abort: mismatched list lengths are
/// caught in Rust, a dtype libtorch refuses comes back as its C++ exception.
#[test]
fn bad_input_is_a_typed_error() {
    let w = Tensor::ones([2], FLOAT);
    let one = std::slice::from_ref(&w);
    let err = fused_adamw(
        &AdamWGroup {
            params: one,
            grads: &[],
            exp_avgs: one,
            exp_avg_sqs: one,
            steps: one,
        },
        H,
    )
    .unwrap_err();
    assert_eq!(err.op, "fused_adamw");
    assert!(err.message.contains("grads has 0 tensors"), "{err}");

    let ints = [Tensor::ones([2], (Kind::Int64, Device::Cpu))];
    let steps = [Tensor::ones([], FLOAT)];
    let err = fused_adamw(
        &AdamWGroup {
            params: &ints,
            grads: &ints,
            exp_avgs: &ints,
            exp_avg_sqs: &ints,
            steps: &steps,
        },
        H,
    )
    .unwrap_err();
    assert_eq!(err.op, "fused_adamw");
    assert!(!err.message.is_empty());
}

#[test]
fn the_device_allocator_reports_peaks_on_cuda_and_is_a_clear_error_without() {
    if !tch::Cuda::is_available() {
        let e = spes_ext::device_memory(0).unwrap_err();
        assert_eq!(e.op, "device_memory");
        assert!(spes_ext::reset_peak_memory(0).is_err());
        return;
    }
    spes_ext::reset_peak_memory(0).unwrap();
    let before = spes_ext::device_memory(0).unwrap();
    let t = Tensor::zeros([1 << 20], (Kind::Float, Device::Cuda(0)));
    let after = spes_ext::device_memory(0).unwrap();
    assert!(
        after.peak_allocated >= before.allocated + (4 << 20),
        "{after:?}"
    );
    assert!(after.peak_reserved >= after.peak_allocated);
    drop(t);
}

#[test]
fn add_lists_adds_each_tensor_to_its_partner() {
    let selves = [
        Tensor::from_slice(&[1.0f32, 2.0]),
        Tensor::from_slice(&[3.0f32]),
    ];
    let others = [
        Tensor::from_slice(&[0.5f32, 0.25]),
        Tensor::from_slice(&[-3.0f32]),
    ];
    add_lists(&selves, &others).unwrap();
    assert_eq!(Vec::<f32>::try_from(&selves[0]).unwrap(), vec![1.5, 2.25]);
    assert_eq!(Vec::<f32>::try_from(&selves[1]).unwrap(), vec![0.0]);
    let e = add_lists(&selves, &others[..1]).unwrap_err();
    assert_eq!(e.op, "add_lists");
}

/// The trained-first grouped matmul computes what `_grouped_mm` over every slot with grad
/// does: the same output and input gradient, and the same weight gradient for the trained
/// slots, while the frozen slots' gradient is never computed (they carry no grad); a group
/// with no rows and a layer with no trained slot work too.
#[test]
fn grouped_mm_trained_first_matches_grouped_mm_and_skips_frozen_weight_gradients() {
    tch::manual_seed(3);
    let (slots, din, dout) = (4i64, 8i64, 16i64);
    // Rows per slot: slot 1 gets none.
    let offsets = Tensor::from_slice(&[3i32, 3, 7, 10]);
    let x0 = Tensor::randn([10, din], FLOAT);
    let w0 = Tensor::randn([slots, dout, din], FLOAT);
    let dy = Tensor::randn([10, dout], FLOAT);
    // Reference: every slot's weight requires grad.
    let x_ref = x0.copy().set_requires_grad(true);
    let w_ref = w0.copy().set_requires_grad(true);
    let y_ref = x_ref.internal_grouped_mm(
        &w_ref.transpose(1, 2),
        Some(&offsets),
        None::<&Tensor>,
        None::<Kind>,
    );
    (&y_ref * &dy).sum(Kind::Float).backward();
    for trained_slots in [2i64, 0] {
        let x = x0.copy().set_requires_grad(true);
        let trained = w0
            .narrow(0, 0, trained_slots)
            .copy()
            .set_requires_grad(true);
        let y = grouped_mm_trained_first(&x, &w0, &trained, &offsets).unwrap();
        assert!(y.allclose(&y_ref, 1e-6, 1e-6, false));
        (&y * &dy).sum(Kind::Float).backward();
        assert!(x.grad().allclose(&x_ref.grad(), 1e-6, 1e-6, false));
        if trained_slots > 0 {
            let want = w_ref.grad().narrow(0, 0, trained_slots);
            assert!(trained.grad().allclose(&want, 1e-6, 1e-6, false));
        }
    }
    let bad = grouped_mm_trained_first(&x0, &w0, &w0, &offsets.narrow(0, 0, 2)).unwrap_err();
    assert_eq!(bad.op, "grouped_mm_trained_first");
}
