// The runtime object: everything the ops share between calls. Exactly one may be current;
// init() replaces it (cleaning up the old one) and cleanup() drops it. Nothing else is global.
#pragma once

#include <deepcompile/common.h>
#include <deepcompile/communicator.h>
#include <deepcompile/executor.h>
#include <deepcompile/grad_reducer.h>
#include <deepcompile/lanes.h>
#include <deepcompile/registry.h>
#include <deepcompile/z3_executor.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace deepcompile {

struct RuntimeConfig {
  int64_t reduce_bucket_size = 500000000;     // elements
  bool double_buffer = true;
  int64_t free_activation_threshold = 10 << 20;  // bytes
  bool sync_before_reduce = false;
  bool sync_after_reduce = false;
  bool sync_before_allgather = false;
  bool sync_after_allgather = false;
};

class Runtime {
 public:
  // `comm` spans the shard group: every gather, reduce-scatter and reduce runs on it, and its
  // rank and size are the ones parameters are partitioned by. `replica_comm` (hybrid sharding
  // only; null otherwise) spans the ranks holding the same shard in the other shard groups: each
  // reduced gradient partition is averaged over it (docs/design/hybrid_sharding.md).
  // `secondary_comm` (hpZ only; null otherwise) spans this rank's node-local secondary group:
  // every ZeRO-3 parameter that is not persistent keeps a secondary copy sharded over it, filled
  // from a gathered buffer when a use releases it, and gathers read that copy over this
  // communicator until the shards change (docs/design/hpz.md).
  Runtime(std::unique_ptr<Lanes> lanes, std::unique_ptr<Communicator> comm, RuntimeConfig config,
          std::unique_ptr<Communicator> replica_comm = nullptr,
          std::unique_ptr<Communicator> secondary_comm = nullptr);
  ~Runtime();
  // Executors and the reducer hold references into the runtime.
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  Communicator& comm() { return *comm_; }
  Communicator* replicaComm() { return replica_comm_.get(); }
  Communicator* secondaryComm() { return secondary_comm_.get(); }
  // hpZ: device bytes held by secondary copies (0 without hpZ).
  int64_t secondaryBytes();
  Lanes& lanes() { return *lanes_; }
  DSParamRegistry& registry() { return registry_; }
  GradReducer& reducer() { return *reducer_; }
  const RuntimeConfig& config() const { return config_; }
  c10::Device device() const { return lanes_->device(); }
  int rank() const { return comm_->rank(); }
  int world() const { return comm_->size(); }

  // Checks that `tensor` lives where the runtime communicates: the same device type *and* index
  // (checkSameDevice).
  void checkDevice(const at::Tensor& tensor, const char* op, const char* what) const;
  // Aborts every communicator (Communicator::abort), without the runtime lock: destroyRuntime
  // calls it when another thread has held the runtime past the shutdown deadline, to end the
  // collective that thread waits in.
  void abortCommunicators() noexcept;
  // Polls the communicators for an asynchronous error (NCCL: a lost peer or network); on one,
  // aborts them and marks the runtime broken. Raises while the runtime is broken. Called at the
  // step's boundaries (start and end of each backward); cheap (no device sync, no collective).
  void checkCommunicators(const char* where);
  // Why the runtime can run no more collectives (empty while it can).
  const std::string& broken() const { return broken_; }

  void registerGraph(GraphId graph_id, const std::vector<DsId>& ids, int stage);
  CustomOpExecutor& executor(GraphId graph_id, const char* op);
  Z3Executor& z3Executor(GraphId graph_id, const char* op);
  void resetExecutors() { executors_.clear(); }
  bool anyExecutorHoldsGather(DsId id) const;

  // Parameter registration and control (the pybind11 control API calls these).
  struct Z3ParamSpec {
    DsId id;
    std::vector<int64_t> shape;
    at::Tensor shard;
    at::Tensor grad_target;  // numel ppr, or empty for frozen parameters
    bool persistent;
    std::optional<at::ScalarType> expected_grad_dtype;
    // The dtype gathers default to (Z3Layout::gather_dtype); unset: the shard's own dtype.
    std::optional<at::ScalarType> gather_dtype = std::nullopt;
  };
  // Validates every shard size on every rank with one collective; all ranks raise together.
  void registerZ3Params(std::vector<Z3ParamSpec> specs);
  void registerZ12Param(DsId id, std::vector<int64_t> shape, at::Tensor param, int64_t group_offset,
                        int64_t partition_numel);
  void bindGradTarget(DsId id, at::Tensor target, bool zero);
  void unbindGradTargets(const std::optional<std::vector<DsId>>& ids);
  void setPersistent(DsId id, bool persistent);
  // Parameter offload: `host` (a CPU tensor of the shard's dtype and numel) holds the ZeRO-3
  // parameter's value from now on and gathers read it (Z3Layout::host_shard); nullopt (or an
  // undefined tensor): gathers read the device shard again. `host_pinned`: whether `host` is
  // page-locked (the bindings ask the driver); a device runtime warns once about a pageable one
  // (hostShardCopiesBlock).
  void setHostShard(DsId id, const std::optional<at::Tensor>& host, bool host_pinned = false);
  // Profiling helpers: forget a gathered buffer without freeing its storage (ZeRO-3 only;
  // clearAllGathered skips ZeRO-1/2 parameters, invalidateGathered rejects them). Both also mark
  // the hpZ secondary copies stale: the next gather reads the shards.
  void invalidateGathered(DsId id);
  void clearAllGathered();
  // After an optimizer step: every gathered copy is stale (ZeRO-3 parameters; others have none).
  void invalidateAllGathered();

  void startBackward(bool update_step);
  // The end of graph `graph_id`'s backward (dc.end_backward): flushes every queued reduction and
  // orders the compute stream after them, without blocking the host.
  void endBackward(GraphId graph_id, bool release_reduce_buckets);
  bool updateStep() const { return update_step_; }
  // While profiling, graphs run for measurement only: reduce_grad, end_backward and free_tensors
  // leave every piece of state as it is.
  void setProfiling(bool enabled) { profiling_ = enabled; }
  bool profiling() const { return profiling_; }

  // After a forward or backward raised (docs/design/runtime.md, "What happens on failure"):
  // waits for every lane and for the collectives of aborted groups, drops queued gradient
  // reductions and bucket contents, forgets release counts, frees non-persistent gathered
  // buffers and reopens the accumulation window (the failed window's gradients are dropped), so
  // the next step starts as if the failed one never ran. Not a collective: every rank that saw
  // the error calls it.
  void abortStep();

  // Waits for all in-flight work, at most `timeout_s` seconds (then, or as soon as a
  // communicator reports an asynchronous error, every communicator is aborted so that nothing
  // waits for peers that are gone), then drops buffers and communicators. Best effort: every
  // step runs whatever an earlier one hit, and it never throws; returns the first error (empty:
  // none). Afterwards the runtime holds nothing and shutdown() returns at once.
  std::string shutdown(double timeout_s = kDefaultShutdownTimeoutS) noexcept;
  static constexpr double kDefaultShutdownTimeoutS = 60.0;

 private:
  void forgetGathered(Z3Layout& z3);
  // Waits until every lane is idle, polling against the deadline and the communicators'
  // asynchronous errors; aborts every communicator on either. The error, or empty.
  std::string drainLanes(double timeout_s);
  // Before an id is registered again: frees the gathered buffer of the entry it replaces.
  void freeGatheredOf(DsId id);
  // Declaration order is construction order: the executor context refers to everything above it.
  std::unique_ptr<Lanes> lanes_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Communicator> replica_comm_;
  std::unique_ptr<Communicator> secondary_comm_;
  RuntimeConfig config_;
  DSParamRegistry registry_;
  bool update_step_ = false;
  // The previous backward closed an accumulation window; the next one opens a new window.
  bool window_closed_ = true;
  bool profiling_ = false;
  bool warned_pageable_host_shard_ = false;  // setHostShard warns once per runtime
  std::string broken_;  // checkCommunicators: why no collective can run any more (empty: they can)
  std::unique_ptr<GradReducer> reducer_;
  ExecutorContext executor_context_;
  std::map<GraphId, std::unique_ptr<CustomOpExecutor>> executors_;
};

// Raises unless a tensor on `tensor` may be used by a runtime on `runtime`: the same device type,
// and for a device with an index (cuda:0) the same index. The message names both devices. A
// tensor on cuda:1 handed to a runtime on cuda:0 used to pass (the type matched); NCCL then read
// the other GPU's memory through peer access, or failed with an illegal address.
void checkSameDevice(const c10::Device& tensor, const c10::Device& runtime, const char* op, const char* what);

// Whether gathers reading a host shard of a runtime on `runtime` copy it synchronously: a
// pageable (not page-locked) host tensor makes every host-to-device copy a blocking one (the
// driver stages it through its own pinned buffer), so the gather lane no longer overlaps anything.
// A CPU runtime reads host shards in place.
bool hostShardCopiesBlock(const c10::Device& runtime, bool pinned);

// Serializes the runtime's entry points (docs/design/runtime.md, "Threads"). Every dc op kernel
// and every control call that changes runtime state holds it for its whole duration; it is
// recursive because ops call one another (the slot overloads). Not an owning-thread assertion: on
// CUDA, autograd runs backward nodes (the compiled backward with its reduce_grad, end_backward
// and gathers) on its per-device worker thread, not on the thread that called init, and
// AOTAutograd may compile a backward (whose passes register graphs) there too.
std::recursive_timed_mutex& runtimeMutex();
[[nodiscard]] std::unique_lock<std::recursive_timed_mutex> lockRuntime();

// The current runtime; throws a clear error when init() has not been called.
Runtime& currentRuntime();
bool runtimeInitialized();
void installRuntime(std::unique_ptr<Runtime> runtime);
// Shuts the current runtime down (Runtime::shutdown) and empties the slot, whatever the
// shutdown hit, so that init() works again; an error the shutdown hit is reported as a warning.
// Takes the runtime lock within `timeout_s` (the deadline covers the wait for the lock and the
// shutdown together). If another thread holds the runtime past the deadline (an op stuck in a
// collective whose peer is gone), the communicators are aborted without the lock, which ends
// that collective, and the lock is waited for a little longer; a runtime still held after that
// is left in place (its communicators aborted) with a warning, rather than freed under the
// thread that uses it.
void destroyRuntime(double timeout_s = Runtime::kDefaultShutdownTimeoutS);

}  // namespace deepcompile
