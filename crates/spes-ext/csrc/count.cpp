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
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>

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

// Watching one operator: the sizes of the tensor arguments of each of its calls, at any depth,
// as text ("2x3,4x5" per call, calls separated by ';').
std::mutex g_watch_lock;
std::string g_watch_name;
std::string g_watched;
std::optional<at::CallbackHandle> g_watch_handle;

std::unique_ptr<at::ObserverContext> on_watched(const at::RecordFunction& fn) {
  std::lock_guard<std::mutex> lock(g_watch_lock);
  if (g_watch_name != fn.name()) return nullptr;
  std::ostringstream call;
  if (fn.inputs().empty()) call << '?';
  bool first = true;
  for (const auto& input : fn.inputs()) {
    if (!input.isTensor()) continue;
    if (!first) call << ',';
    first = false;
    auto sizes = input.toTensor().sizes();
    for (size_t i = 0; i < sizes.size(); ++i) call << (i ? "x" : "") << sizes[i];
  }
  if (!g_watched.empty()) g_watched += ';';
  g_watched += call.str();
  return nullptr;
}

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

// Starts recording the tensor argument sizes of every call of operator `name` (e.g.
// "aten::_grouped_mm"), forgetting earlier records; a NULL name stops recording.
char* spes_ext_watch_op(const char* name) {
  return spes_ext::guarded([&] {
    std::lock_guard<std::mutex> install(g_install);
    if (g_watch_handle) {
      at::removeCallback(*g_watch_handle);
      g_watch_handle.reset();
    }
    if (name == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(g_watch_lock);
      g_watch_name = name;
      g_watched.clear();
    }
    g_watch_handle = at::addGlobalCallback(at::RecordFunctionCallback(on_watched)
                                               .needsInputs(true)
                                               .scopes({at::RecordScope::FUNCTION}));
  });
}

// What the watch recorded, as a malloc'd string the caller frees with spes_ext_free_error.
char* spes_ext_watched() {
  std::lock_guard<std::mutex> lock(g_watch_lock);
  return spes_ext::copy_message(g_watched.c_str());
}

// The counts so far, one per phase, into out[0..8].
void spes_ext_op_counts(uint64_t* out) {
  for (int i = 0; i < kPhases; ++i) out[i] = g_counts[i].load(std::memory_order_relaxed);
}

}  // extern "C"
