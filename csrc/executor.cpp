// Gradient reduction (GradReducer) and the executors that need no parameter gathering.
#include <deepcompile/executor.h>
#include <deepcompile/runtime.h>

namespace deepcompile {

// ---------------------------------------------------------------------------------------------
// GradReducer

GradReducer::GradReducer(Runtime& runtime, int64_t bucket_size, bool double_buffer)
    : rt_(runtime),
      buckets_(bucket_size, double_buffer, [&runtime](int64_t numel, at::ScalarType dtype) {
        // Buckets are written on the copy lane and read on the reduce lane; allocating them on
        // the reduce lane keeps the allocator's stream bookkeeping on the lane that frees them.
        LaneScope scope(runtime.lanes(), Lane::ReduceScatter);
        return at::empty({numel}, at::TensorOptions().dtype(dtype).device(runtime.device()));
      }) {}

size_t GradReducer::pendingTasks() const {
  size_t n = 0;
  for (const auto& kv : tasks_) n += kv.second.size();
  return n;
}

void GradReducer::enqueue(DSParam& param, const at::Tensor& grad_in) {
  Lanes& lanes = rt_.lanes();
  const at::Tensor grad = grad_in.detach();
  // Reduced in the dtype the target expects (e.g. bf16 gradients into fp32 partitions). The cast
  // happens in the copy into the bucket slot (copyIntoSlots), on the copy lane: no full-size
  // converted temporary on the compute stream (for an LM head, hundreds of MB at the backward peak).
  const at::ScalarType dtype = param.expected_grad_dtype.value_or(grad.scalar_type());
  // ZeRO-3 slots are padded to world * ppr and zero-filled, so the reduce-scatter never reads
  // past the gradient (the padding tail of the last rank's partition stays exactly zero).
  const int64_t slot_numel = param.partitioned ? param.paddedNumel() : param.numel;

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
    bucket->last_use = lanes.record(Lane::ReduceScatter);
  }

  // The copy into the slot waits for the flush, which copies all of a bucket's gradients in one
  // batch: one compute-stream wait and a few multi-tensor launches per bucket instead of a wait,
  // a copy and a fill per gradient (about 150 per step on a 1B Llama, on the host's critical
  // path of the backward). The task holds the gradient until then; the graph may drop its own
  // reference right after this op, and nothing writes into a gradient once it is handed over.
  tasks_[dtype].push_back(Task{param.id, param.numel, slot, grad});
  // A full bucket (typically one grown for a single large gradient, an LM head or embedding) takes
  // nothing more: reduce it now rather than when the next gradient arrives, which starts its
  // collective earlier and lets its gradient go sooner.
  if (bucket->offset() == bucket->capacity()) flush(dtype);
}

void GradReducer::copyIntoSlots(at::ScalarType dtype, std::vector<Task>& tasks) {
  Lanes& lanes = rt_.lanes();
  const c10::Stream copy_stream = lanes.stream(Lane::Copy);
  // The copy lane writes the slots once (a) every gradient is produced (all were queued on the
  // compute stream before this point) and (b) the last collective that read this bucket's buffer
  // is done. Every task of a flush is in the current bucket: enqueue flushes before moving on.
  lanes.waitCompute(Lane::Copy);
  ReduceBucket& bucket = buckets_.current(dtype);
  if (bucket.last_use) bucket.last_use->blockStream(copy_stream);
  std::vector<at::Tensor> slots, grads, padding;
  {
    LaneScope scope(lanes, Lane::Copy);
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
    lanes.recordStream(task.grad, copy_stream);  // the block is reused only after the copy ran
    task.grad = at::Tensor();
  }
}

void GradReducer::flush(at::ScalarType dtype) {
  auto it = tasks_.find(dtype);
  // Nothing queued for this dtype (e.g. a backward without reductions): nothing to do, and in
  // particular no bucket to swap, which may not even exist any more.
  if (it == tasks_.end() || it->second.empty()) return;
  std::vector<Task> tasks = std::move(it->second);
  tasks_.erase(it);

  Lanes& lanes = rt_.lanes();
  Communicator& comm = rt_.comm();
  const int rank = comm.rank();
  const c10::Stream reduce_stream = lanes.stream(Lane::ReduceScatter);
  copyIntoSlots(dtype, tasks);
  lanes.record(Lane::Copy)->blockStream(reduce_stream);

  struct Landing {
    DSParam* param;
    at::Tensor received;  // where this rank's reduced piece arrived (undefined: in the target)
    bool accumulate;      // add into the target instead of overwriting it
  };
  std::vector<Landing> landings;
  {
    LaneScope scope(lanes, Lane::ReduceScatter);
    // The collectives average (NCCL inside the collective; gloo divides first): no separate
    // division pass over the bucket.
    comm.beginGroup(Lane::ReduceScatter);
    for (const Task& task : tasks) {
      DSParam& param = rt_.registry().get(task.id);
      // Decided per task, in order: a parameter reduced twice in one window (two graphs, or
      // two micro-steps) overwrites its target once and accumulates afterwards.
      const bool accumulate = param.has_acc_grad;
      param.has_acc_grad = true;
      if (param.partitioned) {
        // Receive straight into the target when it can simply be overwritten.
        const at::Tensor& target = param.grad_target;
        const bool direct = !accumulate && target.scalar_type() == dtype;
        at::Tensor recv = direct ? target.view({-1}) : at::empty({param.ppr}, task.slot.options());
        comm.reduceScatter(task.slot, recv);
        landings.push_back({&param, direct ? at::Tensor() : recv, accumulate});
      } else {
        for (const OwnedRange& range : param.ownedRanges()) {
          at::Tensor piece = task.slot.narrow(0, range.begin, range.numel());
          comm.reduce(piece, range.owner);
          if (range.owner == rank) landings.push_back({&param, piece, accumulate});
        }
      }
    }
  }
  CompletionPtr reduced = comm.endGroup();
  reduced->blockStream(reduce_stream);
  {
    LaneScope scope(lanes, Lane::ReduceScatter);
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
  buckets_.swap(dtype, lanes.record(Lane::ReduceScatter));
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

// ---------------------------------------------------------------------------------------------
// Executors

CustomOpExecutor::CustomOpExecutor(Runtime& runtime, GraphId graph_id, std::vector<DsId> ids, int stage)
    : rt_(runtime), graph_id_(graph_id), ids_(std::move(ids)), id_set_(ids_.begin(), ids_.end()), stage_(stage) {}

DSParam& CustomOpExecutor::param(DsId id, const char* op) {
  TORCH_CHECK(hasParam(id), "dc.", op, ": ds id ", id, " is not a parameter of graph ", graph_id_,
              " (registered ids: ", ids_.size(), ")");
  return rt_.registry().get(id);
}

void CustomOpExecutor::checkGradient(const DSParam& p, const at::Tensor& grad, const char* op) const {
  TORCH_CHECK(grad.numel() == p.numel, "dc.", op, ": gradient of ds id ", p.id, " has ", grad.numel(),
              " elements but the parameter has ", p.numel);
}

void CustomOpExecutor::reduceGrad(const at::Tensor& grad, DsId id, const char* op) {
  DSParam& p = param(id, op);
  checkGradient(p, grad, op);
  const int64_t local = p.localGradNumel(rt_.rank());
  if (!p.grad_target.defined() && p.partitioned && p.expected_grad_dtype.has_value()) {
    // ZeRO-3 trainable parameter without a bound target: its gradient partition is allocated
    // now, at its first reduction of the window, on the compute stream (the optimizer's), and
    // dropped by unbind_grad_targets after the step. Allocating here rather than for the whole
    // step keeps gradient partitions out of the activation peak at the start of the backward.
    // No reduction reached this parameter in the window yet, so the first one overwrites.
    p.grad_target = at::empty({p.ppr}, at::TensorOptions().dtype(*p.expected_grad_dtype).device(rt_.device()));
    p.has_acc_grad = false;
  }
  TORCH_CHECK(local == 0 || p.grad_target.defined(), "dc.", op, ": ds id ", id,
              " has no gradient target bound (bind_grad_target) on rank ", rt_.rank());
  rt_.reducer().enqueue(p, grad);
}

void Z1Executor::reduceGrad(const at::Tensor& grad, DsId id, const char* op) {
  DSParam& p = param(id, op);
  checkGradient(p, grad, op);
  // ZeRO-1 reduces once per accumulation window: micro-steps accumulate the full local
  // gradient (a private copy: the graph may reuse its own buffer), the update step reduces it.
  if (!rt_.updateStep()) {
    if (p.local_grad_acc.defined()) {
      p.local_grad_acc.add_(grad.reshape(p.local_grad_acc.sizes()));
    } else {
      p.local_grad_acc = grad.detach().clone(at::MemoryFormat::Contiguous);
    }
    return;
  }
  if (p.local_grad_acc.defined()) {
    at::Tensor total = std::move(p.local_grad_acc);
    p.local_grad_acc = at::Tensor();
    total.add_(grad.reshape(total.sizes()));
    CustomOpExecutor::reduceGrad(total, id, op);
  } else {
    CustomOpExecutor::reduceGrad(grad, id, op);
  }
}

}  // namespace deepcompile
