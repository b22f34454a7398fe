// spes-ext: the libtorch operations tch 0.24 does not expose, behind a C ABI.
//
// Tensors cross as the `at::Tensor*` handles torch-sys gives out (tch's `Tensor::as_ptr`).
// Every entry point catches C++ exceptions and returns them as a malloc'd message (NULL on
// success) for the Rust side to turn into an error and free; nothing unwinds across the FFI.

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/CachingDeviceAllocator.h>

#include "guard.h"

#include <cstdlib>
#include <vector>

namespace {

using spes_ext::guarded;

// The handles as a list of tensors (new references to the same storages).
std::vector<at::Tensor> tensors(at::Tensor* const* handles, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(*handles[i]);
  return out;
}

}  // namespace

extern "C" {

void spes_ext_free_error(char* message) { std::free(message); }

// One AdamW update (decoupled weight decay, bias correction from each tensor's own step
// counter) in libtorch's fused kernel: one pass over each tensor on CPU, a few multi-tensor
// launches on CUDA. The caller advances the counters (spes_ext_add_scalar).
char* spes_ext_fused_adamw(at::Tensor* const* params, at::Tensor* const* grads,
                           at::Tensor* const* exp_avgs, at::Tensor* const* exp_avg_sqs,
                           at::Tensor* const* steps, size_t n, double lr, double beta1,
                           double beta2, double weight_decay, double eps) {
  return guarded([&] {
    if (n == 0) return;
    auto p = tensors(params, n);
    auto g = tensors(grads, n);
    auto m = tensors(exp_avgs, n);
    auto v = tensors(exp_avg_sqs, n);
    auto s = tensors(steps, n);
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, s, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt,
                      /*found_inf=*/std::nullopt);
  });
}

// Scales the gradients in place so their global L2 norm is at most max_norm; *total receives
// the pre-clip norm as a new fp32 scalar tensor on the gradients' device (no host sync).
char* spes_ext_clip_grad_norm(at::Tensor* const* grads, size_t n, double max_norm,
                              at::Tensor** total) {
  return guarded([&] {
    auto g = tensors(grads, n);
    auto norms = at::_foreach_norm(g, 2, at::kFloat);
    auto t = at::linalg_vector_norm(at::stack(norms), 2);
    auto coef = at::clamp_max(at::reciprocal((t + 1e-6) / max_norm), 1.0);
    at::_foreach_mul_(g, coef);
    *total = new at::Tensor(std::move(t));
  });
}

// *out receives the sum of the tensors' squared L2 norms as a new fp32 scalar tensor on their
// device: one rank's part of a global norm when the tensors are split among ranks.
char* spes_ext_sq_norm(at::Tensor* const* ts, size_t n, at::Tensor** out) {
  return guarded([&] {
    auto norms = at::_foreach_norm(tensors(ts, n), 2, at::kFloat);
    *out = new at::Tensor(at::stack(norms).square().sum());
  });
}

// Scales the tensors in place by min(1, max_norm / (norm + 1e-6)), as spes_ext_clip_grad_norm
// does, for a global `norm` computed elsewhere (a 0-d tensor on their device).
char* spes_ext_clip_to_norm(at::Tensor* const* ts, size_t n, const at::Tensor* norm,
                            double max_norm) {
  return guarded([&] {
    if (n == 0) return;
    auto coef = at::clamp_max(at::reciprocal((*norm + 1e-6) / max_norm), 1.0);
    at::_foreach_mul_(tensors(ts, n), coef);
  });
}

// Adds value to every tensor in place.
char* spes_ext_add_scalar(at::Tensor* const* ts, size_t n, double value) {
  return guarded([&] {
    if (n == 0) return;
    auto t = tensors(ts, n);
    at::_foreach_add_(t, value);
  });
}

// Adds others[i] to selves[i] in place, for every i.
char* spes_ext_add_lists(at::Tensor* const* selves, at::Tensor* const* others, size_t n) {
  return guarded([&] {
    if (n == 0) return;
    auto s = tensors(selves, n);
    at::_foreach_add_(s, tensors(others, n));
  });
}

// Sets every tensor to zero in place.
char* spes_ext_zero(at::Tensor* const* ts, size_t n) {
  return guarded([&] {
    if (n == 0) return;
    auto t = tensors(ts, n);
    at::_foreach_zero_(t);
  });
}

// The device allocator's byte counts on accelerator `device` (CUDA): allocated now and at its
// peak, reserved now and at its peak, into out[0..4]. Throws where the process has no CUDA
// allocator (a CPU-only run), which the caller reports as "no device statistics".
char* spes_ext_device_memory(int device, int64_t* out) {
  return guarded([&] {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    auto* allocator = c10::getDeviceAllocator(c10::DeviceType::CUDA);
    auto stats = allocator->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[all].current;
    out[1] = stats.allocated_bytes[all].peak;
    out[2] = stats.reserved_bytes[all].current;
    out[3] = stats.reserved_bytes[all].peak;
  });
}

// Starts the allocator's peaks on accelerator `device` again from its current figures.
char* spes_ext_reset_peak_memory(int device) {
  return guarded([&] {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    c10::getDeviceAllocator(c10::DeviceType::CUDA)
        ->resetPeakStats(static_cast<c10::DeviceIndex>(device));
  });
}

// Makes `device` this thread's current accelerator device (what CUDA contexts, NCCL and
// allocations without an explicit device use).
char* spes_ext_set_device(int device) {
  return guarded([&] { at::accelerator::setDeviceIndex(static_cast<c10::DeviceIndex>(device)); });
}

}  // extern "C"
