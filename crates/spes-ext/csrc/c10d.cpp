// spes-ext, c10d part: a torch.distributed process group (TCPStore rendezvous; Gloo backend, or
// NCCL built by the separately loaded nccl.cpp) behind a C ABI, for data parallelism inside one
// node. Collectives are c10d's own; this file only bundles tensors into flat buckets so one call
// moves many small tensors.

#include <ATen/ATen.h>

#include "guard.h"
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using spes_ext::guarded;

struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> pg;
  int rank;
  int world;
  bool gloo;
};

// Calls `enqueue` (a collective's c10d call, which queues the work and returns its Work) with
// every Gloo group of this process serialized. Why: PyTorch 2.11's flight recorder, one per
// process for all Gloo groups, inserts a group into an unguarded map when it records that
// group's first collective, so two groups of one process starting collectives at once can
// corrupt it (a SIGSEGV in FlightRecorder::recordWithResetEnabled, seen when test ranks run as
// threads). Gloo's calls only queue work, so the lock is held for microseconds; NCCL's first
// call may block until every rank has joined its communicator, so NCCL is not serialized (a
// node runs one group per process).
template <typename F>
auto enqueued(const Group& g, F&& enqueue) {
  if (!g.gloo) return enqueue();
  static std::mutex serial;
  std::lock_guard<std::mutex> lock(serial);
  return enqueue();
}

// nccl.cpp's spes_nccl_backend_new, passed in by the caller that loaded it.
using BackendFactory = char* (*)(void* store, int rank, int world, int64_t timeout_ms, void** out);

// Consecutive runs of tensors of one dtype and device, each at most bucket_bytes (a larger
// tensor is a bucket of its own): the unit of one collective call.
std::vector<std::vector<at::Tensor>> buckets(at::Tensor* const* ts, size_t n, size_t bucket_bytes) {
  std::vector<std::vector<at::Tensor>> out;
  size_t bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = *ts[i];
    size_t b = t.numel() * t.element_size();
    bool fresh = out.empty() || bytes + b > bucket_bytes ||
                 out.back().front().scalar_type() != t.scalar_type() ||
                 out.back().front().device() != t.device();
    if (fresh) {
      out.emplace_back();
      bytes = 0;
    }
    out.back().push_back(t);
    bytes += b;
  }
  return out;
}

// Runs `collective` on each bucket flattened into one contiguous tensor, then copies the
// result back into the bucket's tensors.
template <typename F>
void bucketed(at::Tensor* const* ts, size_t n, size_t bucket_bytes, F&& collective) {
  for (auto& bucket : buckets(ts, n, bucket_bytes)) {
    std::vector<at::Tensor> flat_parts;
    flat_parts.reserve(bucket.size());
    for (auto& t : bucket) flat_parts.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    collective(flat);
    int64_t offset = 0;
    for (auto& t : bucket) {
      int64_t k = t.numel();
      t.copy_(flat.narrow(0, offset, k).view(t.sizes()));
      offset += k;
    }
  }
}

// A reduce in flight: one c10d Work per flattened bucket, the flat buffers it reduces and
// the tensors that receive the result (on every rank, or only on the root of a reduce).
struct PendingMean {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> flats;
  std::vector<std::vector<at::Tensor>> buckets;
  int world;
  bool receives;

  // Waits for every bucket and copies the means back.
  void finish() {
    for (size_t b = 0; b < works.size(); ++b) {
      works[b]->wait();
      if (!receives) continue;
      flats[b].div_(world);
      int64_t offset = 0;
      for (auto& t : buckets[b]) {
        int64_t k = t.numel();
        t.copy_(flats[b].narrow(0, offset, k).view(t.sizes()));
        offset += k;
      }
    }
    works.clear();
  }
};

}  // namespace

extern "C" {

// Joins the group: rank 0 serves the TCPStore at host:port, every rank connects to it; every
// collective (and the rendezvous) fails after timeout_ms instead of hanging on a dead rank.
// The backend is Gloo, or whatever `factory` builds over the store (NCCL) when not NULL.
char* spes_ext_pg_new(const char* host, int port, int rank, int world, int64_t timeout_ms,
                      BackendFactory factory, void** out) {
  return guarded([&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(port);
    o.isServer = rank == 0;
    o.numWorkers = world;
    o.timeout = timeout;
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), o);
    c10::intrusive_ptr<c10d::Backend> pg;
    if (factory != nullptr) {
      void* raw = nullptr;
      if (char* err = factory(store.get(), rank, world, timeout_ms, &raw)) {
        std::string message(err);
        std::free(err);
        throw std::runtime_error(message);
      }
      pg = c10::intrusive_ptr<c10d::Backend>::reclaim(static_cast<c10d::Backend*>(raw));
    } else {
      auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(host));
      pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, opts);
    }
    *out = new Group{store, pg, rank, world, factory == nullptr};
  });
}

void spes_ext_pg_free(void* group) { delete static_cast<Group*>(group); }

// Starts averaging the tensors over the ranks and returns at once: an all-reduce when root < 0
// (every rank gets the means), else a reduce to rank `root` (only it gets them, for half an
// all-reduce's traffic; the others' tensors are left as they were). The tensors get their
// means in spes_ext_pending_finish. Gloo reduces on its own threads and NCCL on its own
// stream, so the caller computes meanwhile (the gradients of the next block).
char* spes_ext_pg_reduce_mean_start(void* group, at::Tensor* const* ts, size_t n, int root,
                                    size_t bucket_bytes, void** out) {
  return guarded([&] {
    auto* g = static_cast<Group*>(group);
    if (root >= g->world) throw std::invalid_argument("reduce: root is not a rank of the group");
    bool receives = root < 0 || root == g->rank;
    auto* p = new PendingMean{{}, {}, buckets(ts, n, bucket_bytes), g->world, receives};
    try {
      for (auto& bucket : p->buckets) {
        std::vector<at::Tensor> parts;
        parts.reserve(bucket.size());
        for (auto& t : bucket) parts.push_back(t.reshape({-1}));
        p->flats.push_back(at::cat(parts));
        std::vector<at::Tensor> io{p->flats.back()};
        if (root < 0) {
          c10d::AllreduceOptions opts;
          opts.reduceOp = c10d::ReduceOp::SUM;
          p->works.push_back(enqueued(*g, [&] { return g->pg->allreduce(io, opts); }));
        } else {
          c10d::ReduceOptions opts;
          opts.reduceOp = c10d::ReduceOp::SUM;
          opts.rootRank = root;
          p->works.push_back(enqueued(*g, [&] { return g->pg->reduce(io, opts); }));
        }
      }
    } catch (...) {
      for (auto& w : p->works) {
        try { w->wait(); } catch (...) {}
      }
      delete p;
      throw;
    }
    *out = p;
  });
}

// Waits for a reduce started above and writes the means; frees it either way.
char* spes_ext_pending_finish(void* pending) {
  auto* p = static_cast<PendingMean*>(pending);
  char* err = guarded([&] { p->finish(); });
  for (auto& w : p->works) {
    try { w->wait(); } catch (...) {}
  }
  delete p;
  return err;
}

// In place on every rank: each tensor becomes root's.
char* spes_ext_pg_broadcast(void* group, at::Tensor* const* ts, size_t n, int root,
                            size_t bucket_bytes) {
  return guarded([&] {
    auto* g = static_cast<Group*>(group);
    bucketed(ts, n, bucket_bytes, [&](at::Tensor& flat) {
      std::vector<at::Tensor> io{flat};
      c10d::BroadcastOptions opts;
      opts.rootRank = root;
      enqueued(*g, [&] { return g->pg->broadcast(io, opts); })->wait();
    });
  });
}

// Waits until every rank has called it.
char* spes_ext_pg_barrier(void* group) {
  return guarded([&] {
    auto* g = static_cast<Group*>(group);
    enqueued(*g, [&] { return g->pg->barrier(); })->wait();
  });
}

}  // extern "C"
