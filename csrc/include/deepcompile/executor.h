// Executors: the per-graph state behind the ops. One executor per compiled graph id; the
// forward and backward graphs of a frame share it. Stage-specific behaviour:
//   ZeRO-1: gradients are accumulated locally over a window and reduced at its update step.
//   ZeRO-2: gradients are reduced every micro-step and accumulated in the partition.
//   ZeRO-3: as ZeRO-2, plus parameter gathering and release.
#pragma once

#include <deepcompile/common.h>
#include <deepcompile/registry.h>
#include <deepcompile/reduce_bucket.h>

#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace deepcompile {

class Runtime;

// Gradient reduction shared by all executors: gradients are copied into per-dtype reduce
// buckets on the copy lane and reduced on the reduce lane, ZeRO-3 parameters with a
// reduce-scatter of a zero-padded slot, ZeRO-1/2 parameters with one reduce per owning rank
// (so each rank receives only its partition, never the full gradient).
class GradReducer {
 public:
  GradReducer(Runtime& runtime, int64_t bucket_size, bool double_buffer);

  void enqueue(DSParam& param, const at::Tensor& grad);
  void flush(at::ScalarType dtype);
  void flushAll();
  void releaseBuckets();
  size_t pendingTasks() const;
  int64_t bucketNumel() const { return buckets_.allocatedNumel(); }

 private:
  struct Task {
    DsId id;
    int64_t numel;
    at::Tensor slot;  // view into the current bucket, written on the copy lane
    at::Tensor grad;  // held until the flush copies it into the slot
  };
  void copyIntoSlots(at::ScalarType dtype, std::vector<Task>& tasks);
  Runtime& rt_;
  DoubleBufferedReduceBucket buckets_;
  std::map<at::ScalarType, std::vector<Task>> tasks_;
};

class CustomOpExecutor {
 public:
  CustomOpExecutor(Runtime& runtime, GraphId graph_id, std::vector<DsId> ids, int stage);
  virtual ~CustomOpExecutor() = default;

  GraphId graphId() const { return graph_id_; }
  int stage() const { return stage_; }
  const std::vector<DsId>& ids() const { return ids_; }
  bool hasParam(DsId id) const { return id_set_.count(id) != 0; }
  // The registry entry of `id`, after checking it belongs to this graph.
  DSParam& param(DsId id, const char* op);

  virtual void reduceGrad(const at::Tensor& grad, DsId id, const char* op);
  // Called by end_backward after all pending reductions finished.
  virtual void endBackward(bool update_step) {}
  // True while a gather episode of `id` has releases outstanding in this graph.
  virtual bool holdsGather(DsId) const { return false; }

 protected:
  void checkGradient(const DSParam& p, const at::Tensor& grad, const char* op) const;

  Runtime& rt_;
  GraphId graph_id_;
  std::vector<DsId> ids_;
  std::unordered_set<DsId> id_set_;
  int stage_;
};

class Z1Executor : public CustomOpExecutor {
 public:
  Z1Executor(Runtime& runtime, GraphId graph_id, std::vector<DsId> ids)
      : CustomOpExecutor(runtime, graph_id, std::move(ids), 1) {}
  void reduceGrad(const at::Tensor& grad, DsId id, const char* op) override;
};

class Z2Executor : public CustomOpExecutor {
 public:
  Z2Executor(Runtime& runtime, GraphId graph_id, std::vector<DsId> ids)
      : CustomOpExecutor(runtime, graph_id, std::move(ids), 2) {}
};

class Z3Executor : public CustomOpExecutor {
 public:
  Z3Executor(Runtime& runtime, GraphId graph_id, std::vector<DsId> ids)
      : CustomOpExecutor(runtime, graph_id, std::move(ids), 3) {}

  at::Tensor allgather(DsId id, std::optional<at::ScalarType> dtype);
  void prefetch(const std::vector<DsId>& ids, const std::vector<at::ScalarType>& dtypes);
  void wait(DsId id);
  void release(DsId id, int64_t n_users);
  void endBackward(bool update_step) override;
  bool holdsGather(DsId id) const override;

 private:
  struct ReleaseCount {
    int64_t remaining = 0;
    int64_t n_users = 0;
  };
  std::unordered_map<DsId, ReleaseCount> releases_;
};

// Starts gathering `params` (in `dtypes`) as one group on the all-gather lane and marks them
// valid; used by allgather_param, prefetch and set_persistent.
void launchGathers(Runtime& rt, const std::vector<DSParam*>& params, const std::vector<at::ScalarType>& dtypes);
// Gathers `param` into a fresh, unregistered buffer (the caller owns it) and waits for it.
at::Tensor gatherPrivateCopy(Runtime& rt, DSParam& param, at::ScalarType dtype);
// Frees a parameter's gathered storage itself (every view of it then has 0 bytes).
void freeGathered(Runtime& rt, DSParam& param);

}  // namespace deepcompile
