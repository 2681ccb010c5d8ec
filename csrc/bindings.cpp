// pybind11 control API of deepcompile._C: runtime lifetime, parameter and graph registration,
// step hooks, profiling switches and introspection for tests. deepcompile/runtime.py wraps it.
#include <deepcompile/fault_injection.h>
#include <deepcompile/pinned_host.h>
#include <deepcompile/runtime.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

namespace py = pybind11;
using namespace deepcompile;

namespace {

// `group`: the shard group (the world without hybrid sharding); `replica_group`: the ranks holding
// the same shard in the other shard groups, or None; `secondary_group`: hpZ's node-local group,
// or None (runtime.h).
void init(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::string& device_type, int64_t device_index,
          int64_t bucket_size, bool double_buffer, int64_t free_threshold, const std::vector<bool>& syncs,
          const std::optional<c10::intrusive_ptr<c10d::ProcessGroup>>& replica_group,
          const std::optional<c10::intrusive_ptr<c10d::ProcessGroup>>& secondary_group) {
  TORCH_CHECK(syncs.size() == 4, "deepcompile: init expects 4 sync flags");
  RuntimeConfig config;
  config.reduce_bucket_size = bucket_size;
  config.double_buffer = double_buffer;
  config.free_activation_threshold = free_threshold;
  config.sync_before_reduce = syncs[0];
  config.sync_after_reduce = syncs[1];
  config.sync_before_allgather = syncs[2];
  config.sync_after_allgather = syncs[3];
  // The old runtime goes first: its communicator must be gone before a new one is created. Not
  // under the runtime lock: destroyRuntime takes it within its deadline, and installRuntime below
  // takes it to fill the slot.
  destroyRuntime();
  std::unique_ptr<Lanes> lanes;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Communicator> replica_comm;
  std::unique_ptr<Communicator> secondary_comm;
  const bool hybrid = replica_group.has_value() && *replica_group;
  const bool hpz = secondary_group.has_value() && *secondary_group;
  if (device_type == "cuda") {
#ifdef DC_WITH_NCCL
    const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(device_index));
    lanes = makeDeviceLanes(device);
    comm = makeNcclCommunicator(group, device, *lanes);
    if (hybrid) replica_comm = makeNcclCommunicator(*replica_group, device, *lanes);
    if (hpz) secondary_comm = makeNcclCommunicator(*secondary_group, device, *lanes);
#else
    TORCH_CHECK(false, "deepcompile was built without NCCL support; device='cuda' is unavailable");
#endif
  } else {
    TORCH_CHECK(device_type == "cpu", "deepcompile: device must be 'cpu' or 'cuda', got '", device_type, "'");
    lanes = makeHostLanes();
    comm = makeProcessGroupCommunicator(group);
    if (hybrid) replica_comm = makeProcessGroupCommunicator(*replica_group);
    if (hpz) secondary_comm = makeProcessGroupCommunicator(*secondary_group);
  }
  installRuntime(std::make_unique<Runtime>(std::move(lanes), std::move(comm), config, std::move(replica_comm),
                                           std::move(secondary_comm)));
}

void registerZ3Params(const std::vector<int64_t>& ids, const std::vector<std::vector<int64_t>>& shapes,
                      const std::vector<at::Tensor>& shards, const std::vector<at::Tensor>& targets,
                      const std::vector<bool>& persistent,
                      const std::vector<std::optional<at::ScalarType>>& expected_dtypes,
                      const std::vector<std::optional<at::ScalarType>>& gather_dtypes) {
  auto lock = lockRuntime();
  Runtime& rt = currentRuntime();
  TORCH_CHECK(shapes.size() == ids.size() && shards.size() == ids.size() && targets.size() == ids.size() &&
                  persistent.size() == ids.size() && expected_dtypes.size() == ids.size() &&
                  gather_dtypes.size() == ids.size(),
              "deepcompile: register_z3_params: argument lists differ in length");
  std::vector<Runtime::Z3ParamSpec> specs;
  for (size_t i = 0; i < ids.size(); ++i) {
    specs.push_back({ids[i], shapes[i], shards[i], targets[i], persistent[i], expected_dtypes[i], gather_dtypes[i]});
  }
  rt.registerZ3Params(std::move(specs));
}

// The ZeRO-3 layout of `id`; a ZeRO-1/2 parameter raises, naming the introspection call.
const Z3Layout& z3Of(int64_t id, const char* call) { return currentRuntime().registry().get(id).z3(call); }

py::object gatheredBuffer(int64_t id) {
  const Z3Layout& z3 = z3Of(id, "deepcompile: gathered_buffer");
  if (!z3.gathered.defined()) return py::none();
  return py::cast(z3.gathered);
}

// ZeRO-3: the shard gathers read from; ZeRO-1/2: the replicated parameter.
at::Tensor registeredData(int64_t id) {
  const DSParam& p = currentRuntime().registry().get(id);
  if (const Z3Layout* z3 = p.maybeZ3()) return z3->shard;
  return p.z12().param;
}

// An exact-size page-locked host buffer (uint8), freed with its storage (deepcompile/pinned_host.h).
at::Tensor pinnedHostBuffer(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "deepcompile: pinned_host_buffer: negative size ", nbytes);
#ifdef DC_WITH_NCCL
  if (nbytes == 0) return at::empty({0}, at::TensorOptions().dtype(at::kByte));
  std::string error;
  void* ptr = allocPinnedHost(static_cast<std::size_t>(nbytes), &error);
  TORCH_CHECK(ptr != nullptr, "deepcompile: could not pin ", nbytes, " bytes of host memory: ", error);
  return at::from_blob(ptr, {nbytes}, [](void* p) { freePinnedHost(p); }, at::TensorOptions().dtype(at::kByte));
#else
  TORCH_CHECK(false, "deepcompile was built without CUDA: pinned host memory is unavailable");
#endif
}

// Whether a host tensor's memory is page-locked, asked of the CUDA driver (torch's is_pinned()
// may not know buffers it did not allocate, such as pinned_host_buffer's).
bool hostTensorIsPinned(const at::Tensor& host) {
#ifdef DC_WITH_NCCL
  if (!host.defined() || !host.device().is_cpu() || host.storage().data() == nullptr) return false;
  return isPinnedHost(host.storage().data());
#else
  (void)host;
  return false;  // no CUDA: nothing is pinned for a device, and a CPU runtime does not ask
#endif
}

}  // namespace

py::dict bytesDict(const CommBytes& b) {
  py::dict d;
  d["all_gather"] = b.all_gather;
  d["reduce_scatter"] = b.reduce_scatter;
  d["reduce"] = b.reduce;
  d["all_reduce"] = b.all_reduce;
  return d;
}

// Payload bytes per communicator since the last reset ("replica" only under hybrid sharding,
// "secondary" only under hpZ), each with the communicator's size (what the wire bytes follow from).
py::dict commBytes(bool reset) {
  Runtime& rt = currentRuntime();
  py::dict out;
  const std::pair<const char*, Communicator*> links[] = {
      {"shard", &rt.comm()}, {"replica", rt.replicaComm()}, {"secondary", rt.secondaryComm()}};
  for (const auto& [link, comm] : links) {
    if (comm == nullptr) continue;
    py::dict counted = bytesDict(comm->bytes());
    counted["size"] = comm->size();
    out[link] = counted;
    if (reset) comm->resetBytes();
  }
  return out;
}

// Control calls that may wait on collectives or the device release the GIL: a gloo worker or
// another Python thread must never be blocked behind a thread that waits for them.
// Every control call that changes runtime state holds the runtime lock (runtime.h, lockRuntime),
// taken after the GIL is released: a thread waiting for the lock never holds the GIL, which a
// gloo worker finishing the lock holder's collective may need. cleanup takes it within its
// deadline (destroyRuntime). Read-only introspection (tests, reports) takes no lock.
PYBIND11_MODULE(_C, m) {
  m.doc() = "deepcompile runtime: control API (the ops are registered as torch.ops.dc.*)";
  // Whether setup.py found CUDA and NCCL (DC_WITH_NCCL): `deepcompile env` reports it.
#ifdef DC_WITH_NCCL
  m.attr("built_with_nccl") = true;
#else
  m.attr("built_with_nccl") = false;
#endif
  m.def("init", &init, "Create the runtime (replacing any previous one)", py::call_guard<py::gil_scoped_release>());
  m.def("cleanup", &destroyRuntime,
        "Destroy the runtime, waiting at most timeout_s for in-flight communication (then aborting the "
        "communicators); always leaves no runtime behind; safe to call when none exists",
        py::arg("timeout_s") = Runtime::kDefaultShutdownTimeoutS, py::call_guard<py::gil_scoped_release>());
  m.def("is_initialized", &runtimeInitialized);
  m.def("reset", [] { auto lock = lockRuntime(); currentRuntime().resetExecutors(); }, py::call_guard<py::gil_scoped_release>());
  m.def("world_size", [] { return currentRuntime().world(); });
  m.def("rank", [] { return currentRuntime().rank(); });
  m.def("replica_size", [] {
    Communicator* replica = currentRuntime().replicaComm();
    return replica != nullptr ? replica->size() : 1;
  });
  m.def("secondary_size", [] {
    Communicator* secondary = currentRuntime().secondaryComm();
    return secondary != nullptr ? secondary->size() : 0;
  });
  m.def("secondary_bytes", [] { return currentRuntime().secondaryBytes(); });
  m.def("comm_bytes", &commBytes, "Payload bytes per communicator since the last reset", py::arg("reset") = false);
  m.def("register_z3_params", &registerZ3Params, py::call_guard<py::gil_scoped_release>());
  m.def("register_z12_param", [](int64_t id, std::vector<int64_t> shape, at::Tensor param, int64_t group_offset,
                                 int64_t partition_numel) {
    auto lock = lockRuntime();
    currentRuntime().registerZ12Param(id, std::move(shape), std::move(param), group_offset, partition_numel);
  }, py::call_guard<py::gil_scoped_release>());
  m.def("bind_grad_target",
        [](int64_t id, at::Tensor target, bool zero) { auto lock = lockRuntime(); currentRuntime().bindGradTarget(id, std::move(target), zero); }, py::call_guard<py::gil_scoped_release>());
  m.def("unbind_grad_targets",
        [](std::optional<std::vector<int64_t>> ids) { auto lock = lockRuntime(); currentRuntime().unbindGradTargets(ids); }, py::call_guard<py::gil_scoped_release>());
  m.def("register_graph", [](int64_t graph_id, std::vector<int64_t> ids, int64_t stage) {
    auto lock = lockRuntime();
    currentRuntime().registerGraph(graph_id, ids, static_cast<int>(stage));
  }, py::call_guard<py::gil_scoped_release>());
  m.def("graph_param_ids", [](int64_t graph_id) { return currentRuntime().executor(graph_id, "graph_param_ids").ids(); });
  m.def("set_persistent", [](int64_t id, bool persistent) { auto lock = lockRuntime(); currentRuntime().setPersistent(id, persistent); }, py::call_guard<py::gil_scoped_release>());
  m.def("set_host_shard", [](int64_t id, std::optional<at::Tensor> host) {
    auto lock = lockRuntime();
    currentRuntime().setHostShard(id, host, host.has_value() && hostTensorIsPinned(*host));
  },
        py::call_guard<py::gil_scoped_release>());
  // The stream of a runtime lane as (stream_id, device_index, device_type): what torch.cuda.Stream
  // wraps, so that Python's offload copies run on the lanes the gathers order themselves against.
  // The return type is spelled out: newer pybind11 types make_tuple's result (typing::Tuple).
  m.def("pinned_host_buffer", &pinnedHostBuffer, "An exact-size page-locked host buffer (uint8)",
        py::call_guard<py::gil_scoped_release>());
  m.def("lane_stream", [](const std::string& name) -> py::tuple {
    Runtime& rt = currentRuntime();
    for (int i = 0; i < kNumLanes; ++i) {
      const Lane lane = static_cast<Lane>(i);
      if (name == laneName(lane)) {
        const c10::StreamData3 data = rt.lanes().stream(lane).pack3();
        return py::make_tuple(static_cast<int64_t>(data.stream_id), static_cast<int64_t>(data.device_index),
                              static_cast<int64_t>(data.device_type));
      }
    }
    TORCH_CHECK(false, "deepcompile: lane_stream: no lane named '", name,
                "' (allgather, reduce-scatter, copy, offload, reload)");
    return py::tuple();
  });
  m.def("abort_step", [] { auto lock = lockRuntime(); currentRuntime().abortStep(); },
        "Abandon a step that raised part-way, so the next one starts clean", py::call_guard<py::gil_scoped_release>());
  // TEST-ONLY (fault_injection.h): the n-th fault point of `kind` from now throws; n=0 disarms.
  m.def("_inject_fault", [](const std::string& kind, int64_t n) { armFault(parseFaultKind(kind), n); });
  m.def("start_backward", [](bool update) { auto lock = lockRuntime(); currentRuntime().startBackward(update); }, py::call_guard<py::gil_scoped_release>());
  m.def("enable_profiling", [](bool enabled) { auto lock = lockRuntime(); currentRuntime().setProfiling(enabled); },
        py::call_guard<py::gil_scoped_release>());
  m.def("is_profiling", [] { return currentRuntime().profiling(); });
  m.def("invalidate_gathered_param", [](int64_t id) { auto lock = lockRuntime(); currentRuntime().invalidateGathered(id); }, py::call_guard<py::gil_scoped_release>());
  m.def("clear_all_gathered_params", [] { auto lock = lockRuntime(); currentRuntime().clearAllGathered(); }, py::call_guard<py::gil_scoped_release>());
  m.def("invalidate_all_gathered", [] { auto lock = lockRuntime(); currentRuntime().invalidateAllGathered(); }, py::call_guard<py::gil_scoped_release>());
  // Introspection (tests, reports).
  // ZeRO-3 state: a ZeRO-1/2 parameter raises (it has no gathered buffer, persistence or gather dtype).
  m.def("is_gathered", [](int64_t id) { return z3Of(id, "deepcompile: is_gathered").isGathered(); });
  m.def("is_persistent", [](int64_t id) { return z3Of(id, "deepcompile: is_persistent").persistent; });
  m.def("secondary_valid", [](int64_t id) { return z3Of(id, "deepcompile: secondary_valid").secondary_valid; });
  m.def("gathered_buffer", &gatheredBuffer);
  m.def("gather_dtype", [](int64_t id) { return z3Of(id, "deepcompile: gather_dtype").gather_dtype; });
  m.def("registered_shard", &registeredData);
  m.def("host_shard", [](int64_t id) -> std::optional<at::Tensor> {
    const Z3Layout& z3 = z3Of(id, "deepcompile: host_shard");
    if (!z3.host_shard.defined()) return std::nullopt;
    return z3.host_shard;
  });
  m.def("pending_reduce_tasks", [] { return currentRuntime().reducer().pendingTasks(); });
  m.def("reduce_bucket_numel", [] { return currentRuntime().reducer().bucketNumel(); });
  m.def("was_reduced", [](int64_t id) { return currentRuntime().registry().get(id).has_acc_grad; });
  m.def("reduce_count", [](int64_t id) { return currentRuntime().registry().get(id).reduce_count; });
  m.def("reduce_counts", [] {
    std::map<int64_t, int64_t> counts;
    currentRuntime().registry().forEach([&counts](DSParam& p) { counts[p.id] = p.reduce_count; });
    return counts;
  });
  m.def("grad_target", [](int64_t id) -> std::optional<at::Tensor> {
    const DSParam& p = currentRuntime().registry().get(id);
    if (!p.grad_target.defined()) return std::nullopt;
    return p.grad_target;
  });
  m.def("holds_grad_target", [](int64_t id) {
    const DSParam& p = currentRuntime().registry().get(id);
    const Z12Layout* z12 = p.maybeZ12();
    return p.grad_target.defined() || (z12 != nullptr && z12->local_grad_acc.defined());
  });
}
