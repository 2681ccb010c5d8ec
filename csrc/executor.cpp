// The executor base (parameter lookup, gradient checks and hand-over to the reducer) and the
// ZeRO-1/2 executors, which need no parameter gathering.
#include <deepcompile/communicator.h>
#include <deepcompile/executor.h>
#include <deepcompile/lanes.h>

namespace deepcompile {

CustomOpExecutor::CustomOpExecutor(ExecutorContext context, GraphId graph_id, std::vector<DsId> ids, int stage)
    : ctx_(std::move(context)), graph_id_(graph_id), ids_(std::move(ids)), id_set_(ids_.begin(), ids_.end()),
      stage_(stage) {}

DsId CustomOpExecutor::idAtSlot(int64_t slot, const char* op) const {
  TORCH_CHECK(slot >= 0 && slot < static_cast<int64_t>(ids_.size()), "dc.", op, ": slot ", slot,
              " is out of range for graph ", graph_id_, ", which has ", ids_.size(), " parameter slots");
  return ids_[slot];
}

DSParam& CustomOpExecutor::param(DsId id, const char* op) {
  TORCH_CHECK(hasParam(id), "dc.", op, ": ds id ", id, " is not a parameter of graph ", graph_id_,
              " (registered ids: ", ids_.size(), ")");
  DSParam& p = ctx_.registry.get(id);
  // register_graph checked the layouts, but a parameter may have been registered again since,
  // for the other stage: this graph's ops must not read a layout the parameter no longer has.
  TORCH_CHECK(p.stage() == layoutStage(), "dc.", op, ": ", p.stageMismatch(layoutStage()), " (graph ", graph_id_,
              " was registered for ZeRO-", stage_, " and the parameter was registered again since)");
  return p;
}

void CustomOpExecutor::checkGradient(const DSParam& p, const at::Tensor& grad, const char* op) const {
  TORCH_CHECK(grad.numel() == p.numel, "dc.", op, ": gradient of ds id ", p.id, " has ", grad.numel(),
              " elements but the parameter has ", p.numel);
}

void CustomOpExecutor::reduceGrad(const at::Tensor& grad, DsId id, const char* op) {
  DSParam& p = param(id, op);
  checkGradient(p, grad, op);
  reduce(p, grad, op);
  ++p.reduce_count;
}

void CustomOpExecutor::enqueue(DSParam& p, const at::Tensor& grad, const char* op) {
  const int rank = ctx_.comm.rank();
  const int64_t local = p.localGradNumel(rank);
  const Z3Layout* z3 = p.maybeZ3();
  if (!p.grad_target.defined() && z3 != nullptr && p.expected_grad_dtype.has_value()) {
    // ZeRO-3 trainable parameter without a bound target: its gradient partition is allocated
    // now, at its first reduction of the window, on the compute stream (the optimizer's), and
    // dropped by unbind_grad_targets after the step. Allocating here rather than for the whole
    // step keeps gradient partitions out of the activation peak at the start of the backward.
    // No reduction reached this parameter in the window yet, so the first one overwrites.
    p.grad_target =
        at::empty({z3->ppr}, at::TensorOptions().dtype(*p.expected_grad_dtype).device(ctx_.lanes.device()));
    p.has_acc_grad = false;
  }
  TORCH_CHECK(local == 0 || p.grad_target.defined(), "dc.", op, ": ds id ", p.id,
              " has no gradient target bound (bind_grad_target) on rank ", rank);
  ctx_.reducer.enqueue(p, grad);
}

void Z1Executor::reduce(DSParam& p, const at::Tensor& grad, const char* op) {
  // ZeRO-1 reduces once per accumulation window: micro-steps accumulate the full local
  // gradient (a private copy: the graph may reuse its own buffer), the update step reduces it.
  at::Tensor& acc = p.z12("dc.reduce_grad").local_grad_acc;
  if (!ctx_.update_step) {
    if (acc.defined()) {
      acc.add_(grad.reshape(acc.sizes()));
    } else {
      acc = grad.detach().clone(at::MemoryFormat::Contiguous);
    }
    return;
  }
  if (acc.defined()) {
    at::Tensor total = std::move(acc);
    acc = at::Tensor();
    total.add_(grad.reshape(total.sizes()));
    enqueue(p, total, op);
  } else {
    enqueue(p, grad, op);
  }
}

}  // namespace deepcompile
