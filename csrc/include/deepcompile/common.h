// Small vocabulary shared by every part of the runtime.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <memory>

namespace deepcompile {

using DsId = int64_t;     // parameter id (ZeRO-3 ds_id, ZeRO-1/2 optimizer param id)
using GraphId = int64_t;  // id of a compiled graph; forward and backward of one frame share it

// The five side lanes the runtime issues work on. On CUDA each is a dedicated stream; on CPU
// work runs on the caller's thread and completion is tracked through c10d Work handles.
enum class Lane : int { AllGather = 0, ReduceScatter = 1, Copy = 2, Offload = 3, Reload = 4 };
constexpr int kNumLanes = 5;
const char* laneName(Lane lane);

inline int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A token for work that was issued asynchronously (a collective, a copy on a lane).
// CUDA: an event recorded on the issuing stream. CPU: c10d Work handles plus actions that must
// run once the communication finished (copy back from an fp32 staging buffer, take this rank's
// chunk of an all-reduce).
class Completion {
 public:
  virtual ~Completion() = default;
  // Order all later work on `stream` after this completion (CPU: block the caller).
  virtual void blockStream(const c10::Stream& stream) = 0;
  // Block the calling host thread until the work is done.
  virtual void hostWait() = 0;
};
using CompletionPtr = std::shared_ptr<Completion>;

// A completion that is already satisfied.
CompletionPtr readyCompletion();

}  // namespace deepcompile
