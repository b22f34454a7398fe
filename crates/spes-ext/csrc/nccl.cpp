// spes-ext, CUDA part: builds c10d's ProcessGroupNCCL over a store the main shim made, and
// tells what a CUDA device is. It is a shared library of its own, linked against
// libtorch_cuda, and loaded only when a run needs it, so the spes binary still starts on
// machines without CUDA libraries.

#include "guard.h"
#include <ATen/cuda/CUDAContext.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <chrono>
#include <cstring>

extern "C" {

// Joins an NCCL group of `world` ranks over `store` (a c10d::Store the caller keeps alive;
// this takes its own reference). On success *out is a c10d::Backend* carrying one reference,
// for the caller to reclaim.
char* spes_nccl_backend_new(void* store, int rank, int world, int64_t timeout_ms, void** out) {
  return spes_ext::guarded([&] {
    auto s = c10::intrusive_ptr<c10d::Store>::reclaim_copy(static_cast<c10d::Store*>(store));
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = std::chrono::milliseconds(timeout_ms);
    c10::intrusive_ptr<c10d::Backend> pg =
        c10::make_intrusive<c10d::ProcessGroupNCCL>(s, rank, world, opts);
    *out = pg.release();
  });
}

// The NCCL version libtorch was built with, e.g. 22703 for 2.27.3.
int spes_nccl_version() { return NCCL_VERSION_CODE; }

// CUDA device `device`'s compute capability and name (NUL-terminated, cut to `name_len`).
char* spes_cuda_device(int device, int* major, int* minor, char* name, size_t name_len) {
  return spes_ext::guarded([&] {
    const cudaDeviceProp* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device));
    *major = p->major;
    *minor = p->minor;
    std::strncpy(name, p->name, name_len - 1);
    name[name_len - 1] = '\0';
  });
}

}  // extern "C"
