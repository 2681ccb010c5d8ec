// TEST-ONLY fault injection: makes the Nth gathered-buffer allocation, collective or completion wait
// (counted from when it is armed) throw, so tests can prove that a failure inside a communicator
// group leaves the runtime usable (docs/design/runtime.md, "What happens on failure"). Armed only
// through deepcompile._C._inject_fault (deepcompile.runtime._inject_fault); unarmed, a fault point
// is one relaxed atomic load. Header-only: the inline counters are shared by every translation
// unit of the extension, the NCCL communicator's included.
#pragma once

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

namespace deepcompile {

// CompletionWait: the wait on a group's completion fails (the process-group communicator; a
// peer's failure surfaces there on gloo). AsyncError: the runtime's step-time poll of its
// communicator reports an asynchronous error (what ncclCommGetAsyncError reports for a lost peer
// or network), which gloo never does.
enum class FaultKind : int { GatherAlloc = 0, Collective = 1, CompletionWait = 2, AsyncError = 3 };
inline constexpr int kNumFaultKinds = 4;

inline const char* faultKindName(FaultKind kind) {
  switch (kind) {
    case FaultKind::GatherAlloc: return "gather_alloc";
    case FaultKind::Collective: return "collective";
    case FaultKind::CompletionWait: return "completion_wait";
    case FaultKind::AsyncError: return "async_error";
  }
  return "unknown";
}

// Countdown per kind: 0 = disarmed; n > 0 = the n-th fault point of that kind from now throws.
inline std::array<std::atomic<int64_t>, kNumFaultKinds> g_fault_countdown{};

inline FaultKind parseFaultKind(const std::string& name) {
  if (name == "gather_alloc") return FaultKind::GatherAlloc;
  if (name == "completion_wait") return FaultKind::CompletionWait;
  if (name == "async_error") return FaultKind::AsyncError;
  TORCH_CHECK(name == "collective", "deepcompile: _inject_fault: unknown fault kind '", name,
              "' (expected 'gather_alloc', 'collective', 'completion_wait' or 'async_error')");
  return FaultKind::Collective;
}

// n >= 1 arms the kind (the n-th point from now throws, once); n == 0 disarms it.
inline void armFault(FaultKind kind, int64_t n) {
  TORCH_CHECK(n >= 0, "deepcompile: _inject_fault: n must be >= 0, got ", n);
  g_fault_countdown[static_cast<int>(kind)].store(n, std::memory_order_relaxed);
}

// Whether the armed countdown of `kind` hits zero at this point (for faults that are reported,
// not thrown).
inline bool faultFires(FaultKind kind) {
  std::atomic<int64_t>& countdown = g_fault_countdown[static_cast<int>(kind)];
  if (countdown.load(std::memory_order_relaxed) <= 0) return false;
  return countdown.fetch_sub(1, std::memory_order_relaxed) == 1;
}

// Called where a fault of `kind` could happen for real; throws when the armed countdown hits zero.
inline void faultPoint(FaultKind kind, const char* where) {
  if (!faultFires(kind)) return;
  TORCH_CHECK(false, "deepcompile: injected test fault (", faultKindName(kind), ") at ", where);
}

}  // namespace deepcompile
