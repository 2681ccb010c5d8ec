// Gradient reduction shared by all executors: gradients are copied into per-dtype reduce
// buckets on the copy lane and reduced on the reduce lane, ZeRO-3 parameters with a
// reduce-scatter of a zero-padded slot, ZeRO-1/2 parameters with one reduce per owning rank
// (so each rank receives only its partition, never the full gradient). Under hybrid sharding the
// communicator spans the shard group and each received partition is then averaged over the
// replica communicator (the ranks holding the same partition in the other shard groups).
#pragma once

#include <deepcompile/common.h>
#include <deepcompile/reduce_bucket.h>
#include <deepcompile/registry.h>

#include <map>
#include <vector>

namespace deepcompile {

class Communicator;
class Lanes;

class GradReducer {
 public:
  // The registry is where flushes find each task's parameter (its target and window state);
  // lanes and communicator are where the copies and collectives are issued.
  GradReducer(DSParamRegistry& registry, Lanes& lanes, Communicator& comm, int64_t bucket_size, bool double_buffer,
              Communicator* replica_comm = nullptr);

  void enqueue(DSParam& param, const at::Tensor& grad);
  void flush(at::ScalarType dtype);
  void flushAll();
  void releaseBuckets();
  // abort_step: drops every queued reduction and the buckets' contents (callers make sure no lane
  // still works on them). The next backward starts with empty buckets.
  void abandon();
  size_t pendingTasks() const;
  // Whether a queued reduction of `id` still waits for its flush (it writes the target the
  // registered parameter had when the gradient was handed over).
  bool hasPending(DsId id) const;
  int64_t bucketNumel() const { return buckets_.allocatedNumel(); }

 private:
  struct Task {
    DsId id;
    int64_t numel;
    at::Tensor slot;  // view into the current bucket, written on the copy lane
    at::Tensor grad;  // held until the flush copies it into the slot
  };
  // Where a reduced gradient piece lands on this rank.
  struct Landing {
    DSParam* param;       // null: this rank receives nothing from the collective
    at::Tensor received;  // where the reduced piece arrived (undefined: in the target)
    bool accumulate;      // add into the target instead of overwriting it
  };
  // One collective of a flush: a reduce-scatter of `send` into `recv` (root < 0) or a reduce of
  // `send` to rank `root`.
  struct Collective {
    at::Tensor send;
    at::Tensor recv;
    int root;
    Landing landing;
  };
  void copyIntoSlots(at::ScalarType dtype, std::vector<Task>& tasks);
  std::vector<Collective> planReductions(const std::vector<Task>& tasks, at::ScalarType dtype, int rank);
  DSParamRegistry& registry_;
  Lanes& lanes_;
  Communicator& comm_;
  Communicator* replica_comm_;  // null: no replicas (every rank is in the one shard group)
  DoubleBufferedReduceBucket buckets_;
  std::map<at::ScalarType, std::vector<Task>> tasks_;
};

}  // namespace deepcompile
