// The lanes: where the runtime puts asynchronous work and how it orders that work against the
// compute stream (the stream current when an op is called).
//
// Lane::Offload and Lane::Reload carry offload copies (moving tensors to host memory and back).
// Python issues them (deepcompile/offload/lanes.py wraps these streams through lane_stream); the
// runtime orders its own reads of offloaded data after them: a gather that reads a host shard
// first waits for the offload lane (gather.cpp).
#pragma once

#include <deepcompile/common.h>

#include <array>

namespace deepcompile {

class Lanes {
 public:
  virtual ~Lanes() = default;

  virtual c10::Device device() const = 0;
  // The stream ATen work of `lane` runs on (CPU: the default CPU stream).
  virtual c10::Stream stream(Lane lane) const = 0;
  // The stream current on the calling thread.
  virtual c10::Stream computeStream() const = 0;

  // `lane` waits for everything queued on the compute stream so far.
  virtual void waitCompute(Lane lane) = 0;
  // Completion of everything queued on `lane` so far.
  virtual CompletionPtr record(Lane lane) = 0;
  // Host blocks until `lane` is idle.
  virtual void synchronize(Lane lane) = 0;
  // Whether everything queued on `lane` has finished, without blocking (the shutdown polls it
  // against a deadline). The default blocks: lanes whose work runs on the caller are always idle.
  virtual bool idle(Lane lane) {
    synchronize(lane);
    return true;
  }
  virtual void synchronizeDevice() = 0;
  // Tell the caching allocator that `tensor` is used on `stream` (no-op on CPU).
  virtual void recordStream(const at::Tensor& tensor, const c10::Stream& stream) = 0;
};

// Lanes on the host: work runs synchronously on the caller, so lane bookkeeping is trivial and
// ordering comes entirely from the communicator's completions.
std::unique_ptr<Lanes> makeHostLanes();
// Lanes on a GPU: one high-priority pool stream per lane, ordered with events. Device-generic
// (it goes through c10's virtual device guard), so this translation unit needs no CUDA headers.
std::unique_ptr<Lanes> makeDeviceLanes(c10::Device device);

// Makes `lane` the current stream for the scope (no-op on CPU).
class LaneScope {
 public:
  LaneScope(Lanes& lanes, Lane lane);
  ~LaneScope();
  LaneScope(const LaneScope&) = delete;
  LaneScope& operator=(const LaneScope&) = delete;

 private:
  c10::Stream previous_;
  bool switched_;
};

}  // namespace deepcompile
