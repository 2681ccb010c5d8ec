// Executors: the per-graph state behind the ops. One executor per compiled graph id; the
// forward and backward graphs of a frame share it. Stage-specific behaviour:
//   ZeRO-1: gradients are accumulated locally over a window and reduced at its update step.
//   ZeRO-2: gradients are reduced every micro-step and accumulated in the partition.
//   ZeRO-3: as ZeRO-2, plus parameter gathering and release (z3_executor.h).
#pragma once

#include <deepcompile/common.h>
#include <deepcompile/grad_reducer.h>
#include <deepcompile/registry.h>

#include <functional>
#include <unordered_set>
#include <vector>

namespace deepcompile {

class Communicator;
class Lanes;

// What executors use of the runtime that owns them. They get this instead of the runtime itself
// so that they depend only on the components below them, and tests can see what they touch.
struct ExecutorContext {
  DSParamRegistry& registry;
  Lanes& lanes;
  Communicator& comm;
  // hpZ's node-local communicator (gathers of parameters whose secondary copy is current); null
  // without hpZ.
  Communicator* secondary_comm;
  GradReducer& reducer;
  // Whether the backward in progress ends an accumulation window; the runtime sets it when a
  // backward starts, and ZeRO-1 reduces only then.
  const bool& update_step;
  // Whether any executor still has releases outstanding for a gather of `id`: several graphs
  // may use one parameter at once (nested frames) and only the last holder frees it.
  std::function<bool(DsId)> any_holds_gather;
};

class CustomOpExecutor {
 public:
  CustomOpExecutor(ExecutorContext context, GraphId graph_id, std::vector<DsId> ids, int stage);
  virtual ~CustomOpExecutor() = default;

  GraphId graphId() const { return graph_id_; }
  int stage() const { return stage_; }
  // The graph's parameter ids in slot order: slot i is the i-th parameter input of the graph
  // (register_graph's order). Compiled code shared by several parameter sets names a parameter
  // by its slot, and each set has an executor of its own (ops.cpp, "slot" overloads).
  const std::vector<DsId>& ids() const { return ids_; }
  DsId idAtSlot(int64_t slot, const char* op) const;
  bool hasParam(DsId id) const { return id_set_.count(id) != 0; }
  // The registry entry of `id`, after checking it belongs to this graph and has the layout of
  // this graph's stage.
  DSParam& param(DsId id, const char* op);
  // The parameter layout of this graph's stage.
  ParamStage layoutStage() const { return stage_ == 3 ? ParamStage::Zero3 : ParamStage::Zero12; }

  // dc.reduce_grad: checks the gradient, hands it to the stage's reduction and counts it in the
  // parameter's window (DSParam::reduce_count) once accepted.
  void reduceGrad(const at::Tensor& grad, DsId id, const char* op);
  // Called by end_backward after all pending reductions finished.
  virtual void endBackward(bool update_step) {}
  // True while a gather episode of `id` has releases outstanding in this graph.
  virtual bool holdsGather(DsId) const { return false; }
  // abort_step: forget the per-step state of a step that failed part-way (release counts).
  virtual void abortStep() {}

 protected:
  // The stage's handling of a checked gradient; by default it is queued for reduction at once.
  virtual void reduce(DSParam& p, const at::Tensor& grad, const char* op) { enqueue(p, grad, op); }
  // Queues `grad` on the reducer, giving a ZeRO-3 trainable parameter its gradient target first.
  void enqueue(DSParam& p, const at::Tensor& grad, const char* op);
  void checkGradient(const DSParam& p, const at::Tensor& grad, const char* op) const;

  ExecutorContext ctx_;
  GraphId graph_id_;
  std::vector<DsId> ids_;
  std::unordered_set<DsId> id_set_;
  int stage_;
};

class Z1Executor : public CustomOpExecutor {
 public:
  Z1Executor(ExecutorContext context, GraphId graph_id, std::vector<DsId> ids)
      : CustomOpExecutor(std::move(context), graph_id, std::move(ids), 1) {}

 protected:
  void reduce(DSParam& p, const at::Tensor& grad, const char* op) override;
};

class Z2Executor : public CustomOpExecutor {
 public:
  Z2Executor(ExecutorContext context, GraphId graph_id, std::vector<DsId> ids)
      : CustomOpExecutor(std::move(context), graph_id, std::move(ids), 2) {}
};

}  // namespace deepcompile
