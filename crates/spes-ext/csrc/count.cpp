// spes-ext: counts the top-level ATen operator calls of a process, by phase.
//
// A global RecordFunction callback over the FUNCTION scope: an operator call with no operator
// call around it on the same thread is counted once, under the phase the process set last; the
// calls an operator makes inside itself (and the kernels it dispatches to) are not. Autograd's
// backward nodes are another scope, so what a node calls counts as top-level, as its launches
// are. Off unless asked: while no callback is installed, the dispatcher skips RecordFunction.

#include <ATen/record_function.h>

#include "guard.h"

#include <array>
#include <atomic>
#include <mutex>
#include <optional>

namespace {

constexpr int kPhases = 8;

std::atomic<int> g_phase{0};
std::array<std::atomic<uint64_t>, kPhases> g_counts{};
thread_local int t_depth = 0;

std::mutex g_install;
std::optional<at::CallbackHandle> g_handle;

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction&) {
  if (t_depth++ == 0) g_counts[g_phase.load(std::memory_order_relaxed)].fetch_add(1, std::memory_order_relaxed);
  return nullptr;
}

void on_end(const at::RecordFunction&, at::ObserverContext*) { --t_depth; }

}  // namespace

extern "C" {

// Installs (on) or removes (off) the counting callback; installing zeroes the counts.
char* spes_ext_count_ops(bool on) {
  return spes_ext::guarded([&] {
    std::lock_guard<std::mutex> lock(g_install);
    if (on && !g_handle) {
      for (auto& c : g_counts) c.store(0);
      g_handle = at::addGlobalCallback(
          at::RecordFunctionCallback(on_start, on_end).scopes({at::RecordScope::FUNCTION}));
    } else if (!on && g_handle) {
      at::removeCallback(*g_handle);
      g_handle.reset();
    }
  });
}

// Makes `phase` (0..8) the one later calls count under; returns the one before.
int spes_ext_set_op_phase(int phase) {
  if (phase < 0 || phase >= kPhases) phase = 0;
  return g_phase.exchange(phase, std::memory_order_relaxed);
}

// The counts so far, one per phase, into out[0..8].
void spes_ext_op_counts(uint64_t* out) {
  for (int i = 0; i < kPhases; ++i) out[i] = g_counts[i].load(std::memory_order_relaxed);
}

}  // extern "C"
