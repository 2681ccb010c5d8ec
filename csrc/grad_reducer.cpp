// GradReducer: copies gradients into reduce buckets on the copy lane and reduces them on the
// reduce lane into each parameter's gradient target.
#include <deepcompile/communicator.h>
#include <deepcompile/grad_reducer.h>
#include <deepcompile/lanes.h>

namespace deepcompile {

GradReducer::GradReducer(DSParamRegistry& registry, Lanes& lanes, Communicator& comm, int64_t bucket_size,
                         bool double_buffer, Communicator* replica_comm)
    : registry_(registry),
      lanes_(lanes),
      comm_(comm),
      replica_comm_(replica_comm),
      buckets_(bucket_size, double_buffer, [&lanes](int64_t numel, at::ScalarType dtype) {
        // Buckets are written on the copy lane and read on the reduce lane; allocating them on
        // the reduce lane keeps the allocator's stream bookkeeping on the lane that frees them.
        LaneScope scope(lanes, Lane::ReduceScatter);
        return at::empty({numel}, at::TensorOptions().dtype(dtype).device(lanes.device()));
      }) {}

size_t GradReducer::pendingTasks() const {
  size_t n = 0;
  for (const auto& kv : tasks_) n += kv.second.size();
  return n;
}

bool GradReducer::hasPending(DsId id) const {
  for (const auto& kv : tasks_) {
    for (const Task& t : kv.second) {
      if (t.id == id) return true;
    }
  }
  return false;
}

void GradReducer::enqueue(DSParam& param, const at::Tensor& grad_in) {
  const at::Tensor grad = grad_in.detach();
  // Reduced in the dtype the target expects (e.g. bf16 gradients into fp32 partitions). The cast
  // happens in the copy into the bucket slot (copyIntoSlots), on the copy lane: no full-size
  // converted temporary on the compute stream (for an LM head, a large one at the backward peak).
  const at::ScalarType dtype = param.expected_grad_dtype.value_or(grad.scalar_type());
  // ZeRO-3 slots are padded to world * ppr and zero-filled, so the reduce-scatter never reads
  // past the gradient (the padding tail of the last rank's partition stays exactly zero).
  const Z3Layout* z3 = param.maybeZ3();
  const int64_t slot_numel = z3 != nullptr ? z3->padded_numel : param.numel;

  ReduceBucket* bucket = &buckets_.current(dtype);
  if (bucket->shouldFlush(slot_numel)) {
    flush(dtype);
    bucket = &buckets_.current(dtype);
  }
  // A slot larger than the bucket (e.g. an LM head above reduce_bucket_size) grows it. No host
  // wait for the collective that last read the old buffer: the buffer was allocated on the
  // reduce lane, so the allocator hands its block out again only in that lane's order (on CPU
  // the pending collective keeps it alive), and a fresh buffer (below) makes the copy lane wait
  // for the reduce lane's queued work. A host wait here stalled every backward once per step.
  if (slot_numel > bucket->capacity()) bucket->reserve(slot_numel);
  const bool fresh_buffer = !bucket->allocated();
  at::Tensor slot = bucket->allocate(slot_numel);
  if (fresh_buffer) {
    // The buffer was just allocated from the reduce lane's pool, possibly reusing a block (e.g.
    // a flush's receive temporary) that the reduce lane still reads. The copy lane writes it, so
    // it must wait for the reduce lane's queued work first.
    bucket->last_use = lanes_.record(Lane::ReduceScatter);
  }

  // The copy into the slot waits for the flush, which copies all of a bucket's gradients in one
  // batch: one compute-stream wait and a few multi-tensor launches per bucket instead of a wait,
  // a copy and a fill per gradient, each on the host's critical path of the backward. The task
  // holds the gradient until then; the graph may drop its own reference right after this op,
  // and nothing writes into a gradient once it is handed over.
  tasks_[dtype].push_back(Task{param.id, param.numel, slot, grad});
  // A full bucket (typically one grown for a single large gradient, an LM head or embedding) takes
  // nothing more: reduce it now rather than when the next gradient arrives, which starts its
  // collective earlier and lets its gradient go sooner.
  if (bucket->offset() == bucket->capacity()) flush(dtype);
}

void GradReducer::copyIntoSlots(at::ScalarType dtype, std::vector<Task>& tasks) {
  const c10::Stream copy_stream = lanes_.stream(Lane::Copy);
  // The copy lane writes the slots once (a) every gradient is produced (all were queued on the
  // compute stream before this point) and (b) the last collective that read this bucket's buffer
  // is done. Every task of a flush is in the current bucket: enqueue flushes before moving on.
  lanes_.waitCompute(Lane::Copy);
  ReduceBucket& bucket = buckets_.current(dtype);
  if (bucket.last_use) bucket.last_use->blockStream(copy_stream);
  std::vector<at::Tensor> slots, grads, padding;
  {
    LaneScope scope(lanes_, Lane::Copy);
    for (const Task& task : tasks) {
      at::Tensor into = task.slot.narrow(0, 0, task.numel);
      if (task.grad.is_contiguous()) {
        slots.push_back(into);
        grads.push_back(task.grad.view({-1}));
      } else {
        // One pass straight from the gradient's layout: flattening it first would materialise a
        // contiguous clone, a second full pass.
        into.view(task.grad.sizes()).copy_(task.grad);
      }
      if (task.slot.numel() > task.numel) padding.push_back(task.slot.narrow(0, task.numel, task.slot.numel() - task.numel));
    }
    // The cast to the bucket's dtype (bf16 gradients into an fp32 bucket) happens in this copy.
    if (!slots.empty()) at::_foreach_copy_(slots, grads);
    if (!padding.empty()) at::_foreach_zero_(padding);
  }
  for (Task& task : tasks) {
    lanes_.recordStream(task.grad, copy_stream);  // the block is reused only after the copy ran
    task.grad = at::Tensor();
  }
}

std::vector<GradReducer::Collective> GradReducer::planReductions(const std::vector<Task>& tasks, at::ScalarType dtype,
                                                                 int rank) {
  std::vector<Collective> plan;
  LaneScope scope(lanes_, Lane::ReduceScatter);
  for (const Task& task : tasks) {
    DSParam& param = registry_.get(task.id);
    // Decided per task, in order: a parameter reduced twice in one window (two graphs, or
    // two micro-steps) overwrites its target once and accumulates afterwards.
    const bool accumulate = param.has_acc_grad;
    param.has_acc_grad = true;
    if (const Z3Layout* z3 = param.maybeZ3()) {
      // Receive straight into the target when it can simply be overwritten.
      const at::Tensor& target = param.grad_target;
      const bool direct = !accumulate && target.scalar_type() == dtype;
      at::Tensor recv = direct ? target.view({-1}) : at::empty({z3->ppr}, task.slot.options());
      plan.push_back({task.slot, recv, -1, {&param, direct ? at::Tensor() : recv, accumulate}});
    } else {
      for (const OwnedRange& range : param.ownedRanges()) {
        at::Tensor piece = task.slot.narrow(0, range.begin, range.numel());
        Landing landing{nullptr, at::Tensor(), false};
        if (range.owner == rank) landing = {&param, piece, accumulate};
        plan.push_back({piece, at::Tensor(), range.owner, landing});
      }
    }
  }
  return plan;
}

void GradReducer::abandon() {
  // Queued gradients belong to the failed step; the buckets may hold their half-filled slots.
  tasks_.clear();
  buckets_.clear();
}

void GradReducer::flush(at::ScalarType dtype) {
  auto it = tasks_.find(dtype);
  // Nothing queued for this dtype (e.g. a backward without reductions): nothing to do, and in
  // particular no bucket to swap, which may not even exist any more.
  if (it == tasks_.end() || it->second.empty()) return;
  std::vector<Task> tasks = std::move(it->second);
  tasks_.erase(it);

  const int rank = comm_.rank();
  const c10::Stream reduce_stream = lanes_.stream(Lane::ReduceScatter);
  copyIntoSlots(dtype, tasks);
  lanes_.record(Lane::Copy)->blockStream(reduce_stream);

  // Planned before the group opens: the receive temporaries are allocated here, so an
  // allocation failure cannot leave a group half-issued.
  std::vector<Collective> plan = planReductions(tasks, dtype, rank);
  std::vector<Landing> landings;
  for (const Collective& c : plan) {
    if (c.landing.param != nullptr) landings.push_back(c.landing);
  }
  // The gradient targets are written on the reduce lane (received into directly, all-reduced,
  // copied or added to): their blocks must not be handed out again before those writes ran, even
  // if the caller drops a target (unbind_grad_targets, a rebind) while they are queued.
  for (const Landing& landing : landings) {
    if (landing.param->grad_target.defined()) lanes_.recordStream(landing.param->grad_target, reduce_stream);
  }
  {
    CommGroup group(comm_, Lane::ReduceScatter);
    {
      LaneScope scope(lanes_, Lane::ReduceScatter);
      // The collectives average (NCCL inside the collective; gloo divides first): no separate
      // division pass over the bucket.
      for (const Collective& c : plan) {
        if (c.root < 0) {
          comm_.reduceScatter(c.send, c.recv);
        } else {
          comm_.reduce(c.send, c.root);
        }
      }
    }
    group.end()->blockStream(reduce_stream);
  }
  if (replica_comm_ != nullptr && !landings.empty()) {
    // Hybrid sharding: the partition each rank received is the average over its shard group;
    // the same partition arrived on the rank of the same index in every other shard group, so
    // one all-reduce over those ranks completes the average over the world. Issued on the same
    // lane after the shard group's collectives (they wrote what it reads), before the landings
    // are added to accumulated targets. Every replica has the same landings in the same order.
    CommGroup group(*replica_comm_, Lane::ReduceScatter);
    {
      LaneScope scope(lanes_, Lane::ReduceScatter);
      for (const Landing& landing : landings) {
        replica_comm_->allReduce(landing.received.defined() ? landing.received
                                                            : landing.param->grad_target.view({-1}));
      }
    }
    group.end()->blockStream(reduce_stream);
  }
  {
    LaneScope scope(lanes_, Lane::ReduceScatter);
    for (Landing& landing : landings) {
      DSParam& param = *landing.param;
      if (!landing.received.defined()) continue;
      at::Tensor target = param.grad_target.view({-1});
      if (landing.accumulate) {
        target.add_(landing.received.to(target.scalar_type()));
      } else {
        target.copy_(landing.received);
      }
    }
  }
  buckets_.swap(dtype, lanes_.record(Lane::ReduceScatter));
}

void GradReducer::flushAll() {
  std::vector<at::ScalarType> dtypes;
  for (const auto& kv : tasks_) dtypes.push_back(kv.first);
  for (at::ScalarType dtype : dtypes) flush(dtype);
}

void GradReducer::releaseBuckets() {
  TORCH_CHECK(pendingTasks() == 0, "deepcompile: cannot release reduce buckets with ", pendingTasks(),
              " reductions pending");
  // No host wait: the buffers come from the reduce lane's pool, so the allocator hands their
  // blocks only to later reduce-lane allocations, which run after the queued reductions; every
  // copy-lane write into them was ordered before those reductions (flush waits for the copies);
  // and a fresh buffer's first writer waits for the reduce lane (enqueue).
  buckets_.clear();
}

}  // namespace deepcompile
