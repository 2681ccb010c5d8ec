// The op surface: TORCH_LIBRARY(dc) schemas and their CPU, CUDA and Meta kernels.
//
// Argument order follows DeepSpeed's DeepCompile ops, so graph passes written against that
// contract work. Aliasing is declared: ops that return their input say `Tensor(a) -> Tensor(a)`,
// and free_tensors declares that it mutates its inputs. The CPU and CUDA kernels are the same
// device-generic code: the runtime was initialized for one device, and its lanes and
// communicator decide how work is issued; a tensor on another device (type or index) is an error.
// Every kernel that reaches the runtime holds its lock (runtime.h, lockRuntime) for its whole
// duration: on CUDA, backward ops run on autograd's device thread, not the thread that called init.
#include <deepcompile/runtime.h>

#include <torch/library.h>

namespace deepcompile {

namespace {

// Every dc op talks to the runtime and its communicators: host-side state, collectives and copies
// on the runtime's own streams, host waits. A CUDA graph replays only the kernels it captured, so
// a captured dc op would skip all of that on replay; the tag makes Inductor's CUDA graphs leave
// these ops out (graph partitioning splits around them; without it the graph is not captured).
// The one place that names the tag: torch 2.11 and 2.12 both spell it at::Tag::cudagraph_unsafe.
const std::vector<at::Tag>& dcOpTags() {
  static const std::vector<at::Tag> tags{at::Tag::cudagraph_unsafe};
  return tags;
}

void syncIf(bool enabled) {
  if (enabled) currentRuntime().lanes().synchronizeDevice();
}

at::Tensor allgather_param(const at::Tensor& a, int64_t graph_id, int64_t id, std::optional<at::ScalarType> dtype) {
  auto lock = lockRuntime();
  Runtime& rt = currentRuntime();
  rt.checkDevice(a, "allgather_param", "the parameter input");
  Z3Executor& ex = rt.z3Executor(graph_id, "allgather_param");
  syncIf(rt.config().sync_before_allgather);
  at::Tensor out = ex.allgather(id, dtype);
  syncIf(rt.config().sync_after_allgather);
  return out;
}

void prefetch_params_fused(int64_t graph_id, at::TensorList params, at::IntArrayRef ids,
                           std::optional<at::ArrayRef<at::ScalarType>> dtypes) {
  auto lock = lockRuntime();
  Runtime& rt = currentRuntime();
  Z3Executor& ex = rt.z3Executor(graph_id, "prefetch_params_fused");
  // The parameters only document the graph's data flow: the runtime finds them by id. Code that
  // launches a group outside any graph (prefetch across graphs, scheduling/instance_chain.py)
  // passes none.
  TORCH_CHECK(params.empty() || params.size() == ids.size(), "dc.prefetch_params_fused: ", params.size(),
              " params but ", ids.size(), " ids");
  TORCH_CHECK(!dtypes.has_value() || dtypes->size() == ids.size(), "dc.prefetch_params_fused: ", ids.size(),
              " ids but ", dtypes.has_value() ? dtypes->size() : 0, " dtypes");
  std::vector<DsId> id_list(ids.begin(), ids.end());
  std::vector<at::ScalarType> dtype_list;
  for (size_t i = 0; i < id_list.size(); ++i) {
    dtype_list.push_back(dtypes.has_value() ? (*dtypes)[i]
                                            : ex.param(id_list[i], "prefetch_params_fused").z3().gather_dtype);
  }
  ex.prefetch(id_list, dtype_list);
}

at::Tensor wait_allgather(const at::Tensor& a, int64_t graph_id, int64_t id) {
  auto lock = lockRuntime();
  currentRuntime().z3Executor(graph_id, "wait_allgather").wait(id);
  // A fresh view, not the input itself: a non-mutating op below autograd may not return its input.
  return a.alias();
}

at::Tensor release_param(const at::Tensor& a, int64_t graph_id, int64_t id, int64_t n_users) {
  auto lock = lockRuntime();
  currentRuntime().z3Executor(graph_id, "release_param").release(id, n_users);
  return a.alias();
}

at::Tensor reduce_grad(const at::Tensor& grad, int64_t graph_id, int64_t id) {
  auto lock = lockRuntime();
  Runtime& rt = currentRuntime();
  rt.checkDevice(grad, "reduce_grad", "the gradient");
  CustomOpExecutor& ex = rt.executor(graph_id, "reduce_grad");
  if (!rt.profiling()) {
    syncIf(rt.config().sync_before_reduce);
    ex.reduceGrad(grad, id, "reduce_grad");
    syncIf(rt.config().sync_after_reduce);
  }
  return at::empty({0}, grad.options());
}

void end_backward(at::TensorList deps, int64_t graph_id, bool release_reduce_buckets) {
  auto lock = lockRuntime();
  currentRuntime().endBackward(graph_id, release_reduce_buckets);
}

void free_tensors(at::TensorList tensors) {
  auto lock = lockRuntime();
  Runtime& rt = currentRuntime();
  if (rt.profiling()) return;
  for (const at::Tensor& t : tensors) {
    if (!t.defined()) continue;
    // The threshold is in bytes of the tensor itself (DeepSpeed documents bytes but compared
    // element counts).
    if (static_cast<int64_t>(t.numel() * t.element_size()) <= rt.config().free_activation_threshold) continue;
    // Only a tensor that spans its whole storage: a part of a larger one (a slice of a fused
    // buffer, a chunk) shares it with data that is still in use.
    if (t.storage_offset() != 0 ||
        static_cast<size_t>(t.numel() * t.element_size()) != t.storage().nbytes()) continue;
    rt.lanes().recordStream(t, rt.lanes().computeStream());
    t.storage().unsafeGetStorageImpl()->reset();
  }
}

// ---- "slot" overloads: the graph and the parameter are data, not constants.
//
// Compiled code shared by several parameter sets (identical decoder layers compiled once, as
// FSDP2 does) cannot carry ds ids as constants. These overloads take the graph instance as a
// one-element int64 CPU tensor (an input of the compiled graph, saved for its backward) and a
// parameter by its slot in that graph; each instance is registered as a graph of its own, with
// its ds ids in slot order (register_graph), so everything behind the lookup is unchanged. A
// zero-dimensional CPU tensor may sit beside device tensors in one op (fake tensor device
// propagation and the dispatcher both allow it) and is read on the host without a sync.

GraphId graphOf(const at::Tensor& graph, const char* op) {
  TORCH_CHECK(graph.defined() && graph.device().is_cpu() && graph.scalar_type() == at::kLong && graph.dim() == 0,
              "dc.", op, ": the graph argument must be a zero-dimensional int64 CPU tensor holding a graph id");
  return *graph.const_data_ptr<int64_t>();
}

at::Tensor allgather_param_slot(const at::Tensor& a, const at::Tensor& graph, int64_t slot,
                                std::optional<at::ScalarType> dtype) {
  auto lock = lockRuntime();
  Runtime& rt = currentRuntime();
  const GraphId graph_id = graphOf(graph, "allgather_param");
  return allgather_param(a, graph_id, rt.z3Executor(graph_id, "allgather_param").idAtSlot(slot, "allgather_param"),
                         dtype);
}

void prefetch_params_fused_slot(at::TensorList params, const at::Tensor& graph, at::IntArrayRef slots,
                                std::optional<at::ArrayRef<at::ScalarType>> dtypes) {
  auto lock = lockRuntime();
  const GraphId graph_id = graphOf(graph, "prefetch_params_fused");
  Z3Executor& ex = currentRuntime().z3Executor(graph_id, "prefetch_params_fused");
  std::vector<int64_t> ids;
  ids.reserve(slots.size());
  for (int64_t slot : slots) ids.push_back(ex.idAtSlot(slot, "prefetch_params_fused"));
  prefetch_params_fused(graph_id, params, ids, dtypes);
}

at::Tensor wait_allgather_slot(const at::Tensor& a, const at::Tensor& graph, int64_t slot) {
  auto lock = lockRuntime();
  const GraphId graph_id = graphOf(graph, "wait_allgather");
  Z3Executor& ex = currentRuntime().z3Executor(graph_id, "wait_allgather");
  ex.wait(ex.idAtSlot(slot, "wait_allgather"));
  return a.alias();
}

at::Tensor release_param_slot(const at::Tensor& a, const at::Tensor& graph, int64_t slot, int64_t n_users) {
  auto lock = lockRuntime();
  const GraphId graph_id = graphOf(graph, "release_param");
  Z3Executor& ex = currentRuntime().z3Executor(graph_id, "release_param");
  ex.release(ex.idAtSlot(slot, "release_param"), n_users);
  return a.alias();
}

at::Tensor reduce_grad_slot(const at::Tensor& grad, const at::Tensor& graph, int64_t slot) {
  auto lock = lockRuntime();
  const GraphId graph_id = graphOf(graph, "reduce_grad");
  return reduce_grad(grad, graph_id, currentRuntime().executor(graph_id, "reduce_grad").idAtSlot(slot, "reduce_grad"));
}

void end_backward_slot(at::TensorList deps, const at::Tensor& graph, bool release_reduce_buckets) {
  auto lock = lockRuntime();
  currentRuntime().endBackward(graphOf(graph, "end_backward"), release_reduce_buckets);
}

// ---- Meta kernels: shapes and dtypes from the inputs, so that tracing does not depend on what
// the live runtime holds.

at::Tensor allgather_param_meta(const at::Tensor& a, int64_t graph_id, int64_t id,
                                std::optional<at::ScalarType> dtype) {
  // Traced calls pass the parameter's placeholder, which has the full shape (the ZeRO-3 pass,
  // the eager fallback). The real kernel does not check this: eager callers may pass the shard.
  if (dtype.has_value()) return at::empty(a.sizes(), a.options().dtype(*dtype));
  // The schema keeps DeepSpeed's optional dtype, and its default, the parameter's gather dtype,
  // is known only to the registry: `a` may be stored in another dtype (an fp32 master shard of
  // a bf16 parameter). The ZeRO-3 pass and the prefetch planner always name the dtype, so only
  // calls without one read the registry here.
  auto lock = lockRuntime();
  const at::ScalarType gather_dtype = currentRuntime().registry().get(id).z3("dc.allgather_param").gather_dtype;
  return at::empty(a.sizes(), a.options().dtype(gather_dtype));
}

void prefetch_params_fused_meta(int64_t, at::TensorList, at::IntArrayRef, std::optional<at::ArrayRef<at::ScalarType>>) {}

at::Tensor passthrough_meta(const at::Tensor& a, int64_t, int64_t) { return a.alias(); }

at::Tensor release_param_meta(const at::Tensor& a, int64_t, int64_t, int64_t) { return a.alias(); }

at::Tensor reduce_grad_meta(const at::Tensor& grad, int64_t, int64_t) { return at::empty({0}, grad.options()); }

void end_backward_meta(at::TensorList, int64_t, bool) {}

void free_tensors_meta(at::TensorList) {}

at::Tensor allgather_param_slot_meta(const at::Tensor& a, const at::Tensor&, int64_t,
                                     std::optional<at::ScalarType> dtype) {
  // The graph tensor has no data under tracing, so the registry cannot supply a default dtype.
  TORCH_CHECK(dtype.has_value(), "dc.allgather_param.slot: the dtype must be given");
  return at::empty(a.sizes(), a.options().dtype(*dtype));
}

void prefetch_params_fused_slot_meta(at::TensorList, const at::Tensor&, at::IntArrayRef,
                                     std::optional<at::ArrayRef<at::ScalarType>>) {}

at::Tensor passthrough_slot_meta(const at::Tensor& a, const at::Tensor&, int64_t) { return a.alias(); }

at::Tensor release_param_slot_meta(const at::Tensor& a, const at::Tensor&, int64_t, int64_t) { return a.alias(); }

at::Tensor reduce_grad_slot_meta(const at::Tensor& grad, const at::Tensor&, int64_t) {
  return at::empty({0}, grad.options());
}

void end_backward_slot_meta(at::TensorList, const at::Tensor&, bool) {}

}  // namespace

TORCH_LIBRARY(dc, m) {
  m.def("allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype=None) -> Tensor", dcOpTags());
  m.def("prefetch_params_fused(int graph_id, Tensor[] params, int[] ids, ScalarType[]? dtypes=None) -> ()", dcOpTags());
  m.def("wait_allgather(Tensor(a) a, int graph_id, int id) -> Tensor(a)", dcOpTags());
  m.def("release_param(Tensor(a) a, int graph_id, int id, int n_users) -> Tensor(a)", dcOpTags());
  m.def("reduce_grad(Tensor a, int graph_id, int id) -> Tensor", dcOpTags());
  m.def("end_backward(Tensor[] deps, int graph_id, bool release_reduce_buckets) -> ()", dcOpTags());
  m.def("free_tensors(Tensor(a!)[] a) -> ()", dcOpTags());
  m.def("allgather_param.slot(Tensor a, Tensor graph, int slot, ScalarType? dtype=None) -> Tensor", dcOpTags());
  // The parameters come first: Inductor gives a kernel without outputs the device of its first
  // tensor argument, which must be theirs, not the host-side graph tensor's.
  m.def("prefetch_params_fused.slot(Tensor[] params, Tensor graph, int[] slots, ScalarType[]? dtypes=None) -> ()", dcOpTags());
  m.def("wait_allgather.slot(Tensor(a) a, Tensor graph, int slot) -> Tensor(a)", dcOpTags());
  m.def("release_param.slot(Tensor(a) a, Tensor graph, int slot, int n_users) -> Tensor(a)", dcOpTags());
  m.def("reduce_grad.slot(Tensor a, Tensor graph, int slot) -> Tensor", dcOpTags());
  m.def("end_backward.slot(Tensor[] deps, Tensor graph, bool release_reduce_buckets) -> ()", dcOpTags());
}

#define DC_REGISTER_DEVICE_KERNELS(m)                    \
  m.impl("allgather_param", &allgather_param);           \
  m.impl("wait_allgather", &wait_allgather);             \
  m.impl("release_param", &release_param);               \
  m.impl("reduce_grad", &reduce_grad);                   \
  m.impl("free_tensors", &free_tensors)

TORCH_LIBRARY_IMPL(dc, CPU, m) { DC_REGISTER_DEVICE_KERNELS(m); }

TORCH_LIBRARY_IMPL(dc, CUDA, m) { DC_REGISTER_DEVICE_KERNELS(m); }

// Ops whose tensor lists may be empty cannot be dispatched by device: they get a
// device-independent kernel (the runtime knows its device).
TORCH_LIBRARY_IMPL(dc, CompositeExplicitAutograd, m) {
  m.impl("prefetch_params_fused", &prefetch_params_fused);
  m.impl("end_backward", &end_backward);
  // The slot overloads mix a CPU graph tensor with device tensors: one kernel for every device.
  m.impl("allgather_param.slot", &allgather_param_slot);
  m.impl("prefetch_params_fused.slot", &prefetch_params_fused_slot);
  m.impl("wait_allgather.slot", &wait_allgather_slot);
  m.impl("release_param.slot", &release_param_slot);
  m.impl("reduce_grad.slot", &reduce_grad_slot);
  m.impl("end_backward.slot", &end_backward_slot);
}

TORCH_LIBRARY_IMPL(dc, Meta, m) {
  m.impl("allgather_param", &allgather_param_meta);
  m.impl("prefetch_params_fused", &prefetch_params_fused_meta);
  m.impl("wait_allgather", &passthrough_meta);
  m.impl("release_param", &release_param_meta);
  m.impl("reduce_grad", &reduce_grad_meta);
  m.impl("end_backward", &end_backward_meta);
  m.impl("free_tensors", &free_tensors_meta);
  m.impl("allgather_param.slot", &allgather_param_slot_meta);
  m.impl("prefetch_params_fused.slot", &prefetch_params_fused_slot_meta);
  m.impl("wait_allgather.slot", &passthrough_slot_meta);
  m.impl("release_param.slot", &release_param_slot_meta);
  m.impl("reduce_grad.slot", &reduce_grad_slot_meta);
  m.impl("end_backward.slot", &end_backward_slot_meta);
}

}  // namespace deepcompile
