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

  // Checks that `tensor` lives where the runtime communicates.
  void checkDevice(const at::Tensor& tensor, const char* op, const char* what) const;

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
  // undefined tensor): gathers read the device shard again.
  void setHostShard(DsId id, const std::optional<at::Tensor>& host);
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
  void abortCommunicators() noexcept;
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
  std::unique_ptr<GradReducer> reducer_;
  ExecutorContext executor_context_;
  std::map<GraphId, std::unique_ptr<CustomOpExecutor>> executors_;
};

// The current runtime; throws a clear error when init() has not been called.
Runtime& currentRuntime();
bool runtimeInitialized();
void installRuntime(std::unique_ptr<Runtime> runtime);
// Shuts the current runtime down (Runtime::shutdown) and empties the slot, whatever the
// shutdown hit, so that init() works again; an error the shutdown hit is reported as a warning.
void destroyRuntime(double timeout_s = Runtime::kDefaultShutdownTimeoutS);

}  // namespace deepcompile
