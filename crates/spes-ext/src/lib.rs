//! The one C++ shim of spes: libtorch operations that tch 0.24 does not expose, compiled by
//! `build.rs` against the installed libtorch headers (the same libtorch tch links).
//!
//! - [`fused_adamw`]: libtorch's `_fused_adamw_` (one pass per tensor instead of ~10 kernels).
//! - [`clip_grad_norm`]: `_foreach_norm` and `_foreach_mul_`, no host sync.
//! - [`zero`], [`add_scalar`], [`add_lists`]: `_foreach_zero_`, `_foreach_add_`.
//! - [`grouped_mm_trained_first`]: `_grouped_mm` over a layer's experts whose backward
//!   computes weight gradients for the trained experts only.
//! - [`device_memory`], [`reset_peak_memory`], [`set_device`]: the CUDA caching allocator's
//!   statistics and the current device (errors on a process without CUDA).
//! - [`count`]: top-level ATen operator calls by phase of a training step (a RecordFunction
//!   callback, installed only while counting).
//! - [`dist`]: a torch.distributed (c10d) process group (Gloo, or NCCL through [`nccl`]) and
//!   its collectives.
//!
//! Every function works on CPU and CUDA tensors alike. C++ exceptions come back as [`ExtError`].

pub mod count;
pub mod dist;
pub mod nccl;

/// The libtorch this binary was built against ("2.11.0").
pub const BUILT_LIBTORCH: &str = env!("SPES_BUILD_LIBTORCH");
/// The CUDA release of that libtorch ("13.0"), or "none" for a CPU-only libtorch.
pub const BUILT_CUDA: &str = env!("SPES_BUILD_CUDA");

use std::ffi::{c_char, CStr};
use tch::Tensor;
use torch_sys::C_tensor;

/// A libtorch error raised inside the shim, with libtorch's message.
#[derive(Debug, thiserror::Error)]
#[error("libtorch ({op}): {message}")]
pub struct ExtError {
    pub op: &'static str,
    pub message: String,
}

/// Hyper-parameters of one AdamW update (PyTorch's `torch.optim.AdamW` semantics).
#[derive(Clone, Copy, Debug)]
pub struct AdamWHyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
}

/// Parallel lists for [`fused_adamw`]: entry i of each belongs to tensor i.
pub struct AdamWGroup<'a> {
    pub params: &'a [Tensor],
    pub grads: &'a [Tensor],
    pub exp_avgs: &'a [Tensor],
    pub exp_avg_sqs: &'a [Tensor],
    /// fp32 scalar step counters on the parameters' device, one per tensor.
    pub steps: &'a [Tensor],
}

mod ffi {
    use super::*;
    extern "C" {
        pub fn spes_ext_free_error(message: *mut c_char);
        pub fn spes_ext_fused_adamw(
            params: *const *const C_tensor,
            grads: *const *const C_tensor,
            exp_avgs: *const *const C_tensor,
            exp_avg_sqs: *const *const C_tensor,
            steps: *const *const C_tensor,
            n: usize,
            lr: f64,
            beta1: f64,
            beta2: f64,
            weight_decay: f64,
            eps: f64,
        ) -> *mut c_char;
        pub fn spes_ext_clip_grad_norm(
            grads: *const *const C_tensor,
            n: usize,
            max_norm: f64,
            total: *mut *mut C_tensor,
        ) -> *mut c_char;
        pub fn spes_ext_sq_norm(
            ts: *const *const C_tensor,
            n: usize,
            out: *mut *mut C_tensor,
        ) -> *mut c_char;
        pub fn spes_ext_clip_to_norm(
            ts: *const *const C_tensor,
            n: usize,
            norm: *const C_tensor,
            max_norm: f64,
        ) -> *mut c_char;
        pub fn spes_ext_add_lists(
            selves: *const *const C_tensor,
            others: *const *const C_tensor,
            n: usize,
        ) -> *mut c_char;
        pub fn spes_ext_grouped_mm_trained_first(
            x: *const C_tensor,
            all: *const C_tensor,
            trained: *const C_tensor,
            offsets: *const C_tensor,
            out: *mut *mut C_tensor,
        ) -> *mut c_char;
        pub fn spes_ext_zero(ts: *const *const C_tensor, n: usize) -> *mut c_char;
        pub fn spes_ext_add_scalar(ts: *const *const C_tensor, n: usize, value: f64)
            -> *mut c_char;
        pub fn spes_ext_device_memory(device: i32, out: *mut i64) -> *mut c_char;
        pub fn spes_ext_reset_peak_memory(device: i32) -> *mut c_char;
        pub fn spes_ext_set_device(device: i32) -> *mut c_char;
    }
}

/// What the CUDA caching allocator holds on one device, in bytes: what tensors take
/// (allocated) and what it took from the driver (reserved), now and at the peak since the
/// process started or [`reset_peak_memory`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    pub allocated: i64,
    pub peak_allocated: i64,
    pub reserved: i64,
    pub peak_reserved: i64,
}

/// The caching allocator's figures for CUDA device `device`; an error where this process has
/// no CUDA allocator.
pub fn device_memory(device: usize) -> Result<DeviceMemory, ExtError> {
    let mut out = [0i64; 4];
    // SAFETY: `out` holds the four values the shim writes.
    check("device_memory", unsafe {
        ffi::spes_ext_device_memory(device as i32, out.as_mut_ptr())
    })?;
    let [allocated, peak_allocated, reserved, peak_reserved] = out;
    Ok(DeviceMemory {
        allocated,
        peak_allocated,
        reserved,
        peak_reserved,
    })
}

/// Restarts the allocator's peaks on CUDA device `device` from its current figures.
pub fn reset_peak_memory(device: usize) -> Result<(), ExtError> {
    check("reset_peak_memory", unsafe {
        ffi::spes_ext_reset_peak_memory(device as i32)
    })
}

/// Makes CUDA device `device` the current one of the calling thread, as
/// `torch.cuda.set_device` does.
pub fn set_device(device: usize) -> Result<(), ExtError> {
    check("set_device", unsafe {
        ffi::spes_ext_set_device(device as i32)
    })
}

fn handles(ts: &[Tensor]) -> Vec<*const C_tensor> {
    ts.iter().map(|t| t.as_ptr()).collect()
}

/// Turns the shim's returned message (NULL on success) into a Result, freeing it.
fn check(op: &'static str, message: *mut c_char) -> Result<(), ExtError> {
    if message.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string malloc'd by the shim, freed once here.
    let text = unsafe { CStr::from_ptr(message) }
        .to_string_lossy()
        .into_owned();
    unsafe { ffi::spes_ext_free_error(message) };
    Err(ExtError { op, message: text })
}

/// Applies one AdamW update in place to every parameter and its moments, with bias
/// correction from that tensor's own step counter (already advanced for this step). All
/// tensors must share one device, and each list's dtype be uniform (as for PyTorch's
/// `fused=True`).
pub fn fused_adamw(group: &AdamWGroup<'_>, h: AdamWHyper) -> Result<(), ExtError> {
    let n = group.params.len();
    for (what, len) in [
        ("grads", group.grads.len()),
        ("exp_avgs", group.exp_avgs.len()),
        ("exp_avg_sqs", group.exp_avg_sqs.len()),
        ("steps", group.steps.len()),
    ] {
        if len != n {
            return Err(ExtError {
                op: "fused_adamw",
                message: format!("{what} has {len} tensors, params has {n}"),
            });
        }
    }
    let (p, g) = (handles(group.params), handles(group.grads));
    let (m, v, s) = (
        handles(group.exp_avgs),
        handles(group.exp_avg_sqs),
        handles(group.steps),
    );
    // SAFETY: five arrays of n live tensor handles, borrowed for the duration of the call.
    let message = unsafe {
        ffi::spes_ext_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            n,
            h.lr,
            h.beta1,
            h.beta2,
            h.weight_decay,
            h.eps,
        )
    };
    check("fused_adamw", message)
}

/// Scales `grads` in place so their global L2 norm is at most `max_norm` and returns the
/// pre-clip norm as an fp32 scalar on their device (reading it is the only host sync).
pub fn clip_grad_norm(grads: &[Tensor], max_norm: f64) -> Result<Tensor, ExtError> {
    if grads.is_empty() {
        return Ok(Tensor::from(0f32));
    }
    let g = handles(grads);
    let mut total: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: n live handles; on success the shim stores a new heap tensor in `total`.
    let message =
        unsafe { ffi::spes_ext_clip_grad_norm(g.as_ptr(), g.len(), max_norm, &mut total) };
    check("clip_grad_norm", message)?;
    // SAFETY: `total` is a fresh `at::Tensor*` we now own; tch frees it on drop.
    Ok(unsafe { Tensor::from_ptr(total) })
}

/// The sum of the tensors' squared L2 norms, an fp32 scalar on their device: one rank's part
/// of the global norm when gradients are split among ranks. `None` for an empty list.
pub fn sq_norm(ts: &[Tensor]) -> Result<Option<Tensor>, ExtError> {
    if ts.is_empty() {
        return Ok(None);
    }
    let h = handles(ts);
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: n live handles; on success the shim stores a new heap tensor in `out`.
    check("sq_norm", unsafe {
        ffi::spes_ext_sq_norm(h.as_ptr(), h.len(), &mut out)
    })?;
    // SAFETY: `out` is a fresh `at::Tensor*` we now own; tch frees it on drop.
    Ok(Some(unsafe { Tensor::from_ptr(out) }))
}

/// Scales `grads` in place as [`clip_grad_norm`] does, for a global `norm` (a scalar tensor
/// on their device) computed elsewhere, e.g. from every rank's [`sq_norm`].
pub fn clip_to_norm(grads: &[Tensor], norm: &Tensor, max_norm: f64) -> Result<(), ExtError> {
    let h = handles(grads);
    // SAFETY: n live handles and a live norm tensor borrowed for the call.
    check("clip_to_norm", unsafe {
        ffi::spes_ext_clip_to_norm(h.as_ptr(), h.len(), norm.as_ptr(), max_norm)
    })
}

/// Sets every tensor to zero in place, in one multi-tensor call.
pub fn zero(ts: &[Tensor]) -> Result<(), ExtError> {
    let h = handles(ts);
    // SAFETY: n live handles borrowed for the call.
    check("zero", unsafe { ffi::spes_ext_zero(h.as_ptr(), h.len()) })
}

/// Adds `value` to every tensor in place, in one multi-tensor call.
pub fn add_scalar(ts: &[Tensor], value: f64) -> Result<(), ExtError> {
    let h = handles(ts);
    // SAFETY: n live handles borrowed for the call.
    check("add_scalar", unsafe {
        ffi::spes_ext_add_scalar(h.as_ptr(), h.len(), value)
    })
}

/// Adds `others[i]` to `selves[i]` in place for every i, in one multi-tensor call.
pub fn add_lists(selves: &[Tensor], others: &[Tensor]) -> Result<(), ExtError> {
    if selves.len() != others.len() {
        return Err(ExtError {
            op: "add_lists",
            message: format!(
                "{} tensors to add to, {} to add",
                selves.len(),
                others.len()
            ),
        });
    }
    let (s, o) = (handles(selves), handles(others));
    // SAFETY: two arrays of n live handles borrowed for the call.
    check("add_lists", unsafe {
        ffi::spes_ext_add_lists(s.as_ptr(), o.as_ptr(), s.len())
    })
}

/// `x @ all[g]ᵀ` for each row group g of `x` `[N, in]`, the groups given by their end
/// `offsets` (int32, one per slot of `all` `[slots, out, in]`). `all` carries no gradient;
/// `trained` holds the values of its first T slots, and the backward computes weight
/// gradients for those T alone (and the gradient of `x` over every slot).
pub fn grouped_mm_trained_first(
    x: &Tensor,
    all: &Tensor,
    trained: &Tensor,
    offsets: &Tensor,
) -> Result<Tensor, ExtError> {
    let mut out: *mut C_tensor = std::ptr::null_mut();
    // SAFETY: four live tensors borrowed for the call; on success the shim stores a new heap
    // tensor in `out`.
    check("grouped_mm_trained_first", unsafe {
        ffi::spes_ext_grouped_mm_trained_first(
            x.as_ptr(),
            all.as_ptr(),
            trained.as_ptr(),
            offsets.as_ptr(),
            &mut out,
        )
    })?;
    // SAFETY: `out` is a fresh `at::Tensor*` we now own; tch frees it on drop.
    Ok(unsafe { Tensor::from_ptr(out) })
}
