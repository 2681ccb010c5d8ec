#include <deepcompile/fault_injection.h>
#include <deepcompile/gather.h>
#include <deepcompile/runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <unordered_set>

namespace deepcompile {

namespace {

// Runs one stage of a clean-up that must run every stage: the first failure is kept in `first`
// ("what: message"), later ones are dropped.
template <typename Step>
void attemptStage(std::string& first, const char* what, Step&& step) noexcept {
  try {
    step();
  } catch (const std::exception& e) {
    if (first.empty()) first = std::string(what) + ": " + e.what();
  } catch (...) {
    if (first.empty()) first = std::string(what) + ": unknown error";
  }
}

}  // namespace

namespace {

std::unique_ptr<Runtime>& currentSlot() {
  // Deliberately never destroyed by static destruction: tearing down NCCL and CUDA state after
  // the CUDA runtime shut down crashes at exit. Python calls cleanup() at exit instead.
  static auto* runtime = new std::unique_ptr<Runtime>();
  return *runtime;
}

// The slot's runtime, readable without the lock: only destroyRuntime reads it that way, to abort
// the communicators of a runtime another thread holds past the shutdown deadline. Written under
// the lock, together with the slot.
std::atomic<Runtime*>& publishedRuntime() {
  static auto* runtime = new std::atomic<Runtime*>(nullptr);
  return *runtime;
}

// How long destroyRuntime waits for the lock once more after aborting the communicators of a
// runtime that another thread held past the deadline.
constexpr double kLockGraceAfterAbortS = 5.0;

const char* stageName(int stage) {
  switch (stage) {
    case 1: return "ZeRO-1";
    case 2: return "ZeRO-2";
    case 3: return "ZeRO-3";
  }
  return "unknown stage";
}

// checkSameDevice as a predicate (registration collects its errors before raising on every rank).
bool sameDevice(const c10::Device& tensor, const c10::Device& runtime) {
  try {
    checkSameDevice(tensor, runtime, "", "");
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

std::recursive_timed_mutex* runtimeMutexPtr() {
  // Never destroyed, like the slot: a call at exit must still find it.
  static auto* mutex = new std::recursive_timed_mutex();
  return mutex;
}

const RuntimeConfig& validated(const RuntimeConfig& config) {
  TORCH_CHECK(config.reduce_bucket_size > 0, "deepcompile: reduce_bucket_size must be positive, got ",
              config.reduce_bucket_size);
  TORCH_CHECK(config.free_activation_threshold >= 0, "deepcompile: free_activation_threshold must be >= 0");
  return config;
}

}  // namespace

Runtime::Runtime(std::unique_ptr<Lanes> lanes, std::unique_ptr<Communicator> comm, RuntimeConfig config,
                 std::unique_ptr<Communicator> replica_comm, std::unique_ptr<Communicator> secondary_comm)
    : lanes_(std::move(lanes)),
      comm_(std::move(comm)),
      replica_comm_(std::move(replica_comm)),
      secondary_comm_(std::move(secondary_comm)),
      config_(validated(config)),
      reducer_(std::make_unique<GradReducer>(registry_, *lanes_, *comm_, config_.reduce_bucket_size,
                                             config_.double_buffer, replica_comm_.get())),
      executor_context_{registry_, *lanes_, *comm_, secondary_comm_.get(), *reducer_, update_step_,
                        [this](DsId id) { return anyExecutorHoldsGather(id); }} {}

Runtime::~Runtime() { (void)shutdown(); }

void Runtime::abortCommunicators() noexcept {
  for (Communicator* comm : {comm_.get(), replica_comm_.get(), secondary_comm_.get()}) {
    if (comm != nullptr) comm->abort();
  }
}

void Runtime::checkCommunicators(const char* where) {
  if (broken_.empty()) {
    for (Communicator* comm : {comm_.get(), replica_comm_.get(), secondary_comm_.get()}) {
      if (comm == nullptr) continue;
      std::string error = comm->asyncError();
      if (error.empty() && comm == comm_.get() && faultFires(FaultKind::AsyncError)) {
        error = "injected test fault (async_error)";
      }
      if (error.empty()) continue;
      // A communicator with an asynchronous error never completes its outstanding collectives:
      // abort them all now (their waits return), rather than let the next wait hang.
      abortCommunicators();
      broken_ = std::string("the ") + comm->name() + " communicator reported an asynchronous error (" + error +
                ") at " + where + "; the communicators were aborted";
      break;
    }
  }
  TORCH_CHECK(broken_.empty(), "deepcompile: ", broken_,
              ". This runtime can run no more collectives: destroy the engine and initialize a new one, or let a "
              "restarting launcher (torchrun --max-restarts) resume the job from its last checkpoint");
}

std::string Runtime::drainLanes(double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int i = 0; i < kNumLanes; ++i) {
    const Lane lane = static_cast<Lane>(i);
    while (!lanes_->idle(lane)) {
      for (Communicator* comm : {comm_.get(), replica_comm_.get(), secondary_comm_.get()}) {
        const std::string error = comm != nullptr ? comm->asyncError() : std::string();
        if (!error.empty()) {
          abortCommunicators();
          return std::string("the ") + comm->name() + " communicator reported an asynchronous error (" + error +
                 "); the communicators were aborted";
        }
      }
      if (std::chrono::steady_clock::now() > deadline) {
        abortCommunicators();
        return "communication was still in flight after " + std::to_string(timeout_s) +
               " s (a peer gone or stalled?); the communicators were aborted";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return {};
}

std::string Runtime::shutdown(double timeout_s) noexcept {
  if (!comm_) return {};
  std::string first;
  auto attempt = [&first](const char* what, auto&& step) { attemptStage(first, what, step); };
  // Let in-flight collectives and copies finish before their buffers go away, within the deadline.
  attempt("waiting for in-flight communication", [&] {
    const std::string error = drainLanes(timeout_s);
    if (!error.empty() && first.empty()) first = error;
    if (!error.empty()) {  // aborted: what was cut short has stopped, or never will
      for (int i = 0; i < kNumLanes; ++i) lanes_->synchronize(static_cast<Lane>(i));
    }
  });
  registry_.forEachZ3([&](DSParam&, Z3Layout& z3) {
    if (!z3.gather_done) return;
    CompletionPtr done = std::move(z3.gather_done);
    z3.gather_done = nullptr;
    attempt("waiting for a gather", [&] { done->hostWait(); });
  });
  attempt("dropping the executors", [&] { executors_.clear(); });
  attempt("dropping the gradient reducer", [&] { reducer_.reset(); });
  attempt("dropping the registry", [&] { registry_.clear(); });
  attempt("closing the replica communicator", [&] { replica_comm_.reset(); });
  attempt("closing the secondary communicator", [&] { secondary_comm_.reset(); });
  attempt("closing the communicator", [&] { comm_.reset(); });  // null afterwards, even if it threw
  return first;
}

void Runtime::abortStep() {
  // Every stage runs whatever an earlier one raised, and the window is reset in any case; a
  // gather whose collective failed is freed without rethrowing its failure (the step is being
  // abandoned for it). A stage that still fails leaves the runtime refusing every later op.
  std::string first;
  auto attempt = [&first](const char* what, auto&& step) { attemptStage(first, what, step); };
  // Nothing may still write the buffers dropped below: finish every lane's queued work and the
  // collectives of groups that were aborted mid-way.
  attempt("waiting for the lanes", [&] {
    for (int i = 0; i < kNumLanes; ++i) lanes_->synchronize(static_cast<Lane>(i));
  });
  for (Communicator* comm : {comm_.get(), replica_comm_.get(), secondary_comm_.get()}) {
    if (comm != nullptr) attempt("settling aborted groups", [&] { comm->settleAborted(); });
  }
  attempt("dropping queued reductions", [&] { reducer_->abandon(); });
  for (auto& kv : executors_) attempt("resetting an executor", [&] { kv.second->abortStep(); });
  registry_.forEachZ3([&](DSParam&, Z3Layout& z3) {
    // Persistent buffers stay: a failed group already marked its own invalid, and the shards
    // did not change. A non-persistent buffer was gathered for uses that will not run now.
    if (!z3.persistent) attempt("freeing a gathered buffer", [&] { freeGatheredDroppingFailure(*lanes_, z3); });
  });
  // The failed window's targets may hold part of its gradients (flushed buckets): the next
  // backward opens a new window, whose first reduction of each parameter overwrites its target.
  registry_.forEach([](DSParam& p) {
    p.has_acc_grad = false;
    p.reduce_count = 0;
    if (Z12Layout* z12 = p.maybeZ12()) z12->local_grad_acc = at::Tensor();
  });
  window_closed_ = true;
  update_step_ = false;
  if (!first.empty() && broken_.empty()) {
    broken_ = "a failed step could not be abandoned cleanly (" + first +
              "); destroy the engine and initialize it again";
  }
  TORCH_CHECK(first.empty(), "deepcompile: ", broken_);
}

void checkSameDevice(const c10::Device& tensor, const c10::Device& runtime, const char* op, const char* what) {
  // The host has one device: a CPU tensor's index (none, or 0) does not matter.
  const bool any_index = runtime.is_cpu() || !runtime.has_index() || !tensor.has_index();
  const bool same = tensor.type() == runtime.type() && (any_index || tensor.index() == runtime.index());
  TORCH_CHECK(same, "dc.", op, ": ", what, " is on ", tensor, " but the deepcompile runtime was initialized for ",
              runtime, " (every tensor the runtime reads or writes must be on its device)");
}

bool hostShardCopiesBlock(const c10::Device& runtime, bool pinned) { return !runtime.is_cpu() && !pinned; }

void Runtime::checkDevice(const at::Tensor& tensor, const char* op, const char* what) const {
  TORCH_CHECK(tensor.defined(), "dc.", op, ": ", what, " is undefined");
  checkSameDevice(tensor.device(), device(), op, what);
}

void Runtime::registerGraph(GraphId graph_id, const std::vector<DsId>& ids, int stage) {
  TORCH_CHECK(stage >= 1 && stage <= 3, "deepcompile: register_graph: stage must be 1, 2 or 3, got ", stage);
  const ParamStage layout = stage == 3 ? ParamStage::Zero3 : ParamStage::Zero12;
  for (DsId id : ids) {
    const DSParam& p = registry_.get(id);
    TORCH_CHECK(p.stage() == layout, "deepcompile: register_graph: ", p.stageMismatch(layout),
                ", so it cannot be used in a ", stageName(stage), " graph");
  }
  std::unique_ptr<CustomOpExecutor> executor;
  switch (stage) {
    case 1: executor = std::make_unique<Z1Executor>(executor_context_, graph_id, ids); break;
    case 2: executor = std::make_unique<Z2Executor>(executor_context_, graph_id, ids); break;
    default: executor = std::make_unique<Z3Executor>(executor_context_, graph_id, ids); break;
  }
  executors_[graph_id] = std::move(executor);
}

CustomOpExecutor& Runtime::executor(GraphId graph_id, const char* op) {
  // Every op reaches its executor here: none issues a collective on aborted communicators.
  TORCH_CHECK(broken_.empty(), "deepcompile: dc.", op, ": ", broken_,
              ". This runtime can run no more collectives: destroy the engine and initialize a new one");
  auto it = executors_.find(graph_id);
  TORCH_CHECK(it != executors_.end(), "dc.", op, ": graph id ", graph_id,
              " is not registered (register_graph was not called for it, or the runtime was reset)");
  return *it->second;
}

Z3Executor& Runtime::z3Executor(GraphId graph_id, const char* op) {
  CustomOpExecutor& ex = executor(graph_id, op);
  auto* z3 = dynamic_cast<Z3Executor*>(&ex);
  TORCH_CHECK(z3 != nullptr, "dc.", op, " needs a ZeRO-3 executor, but graph id ", graph_id, " was registered for ",
              stageName(ex.stage()));
  return *z3;
}

bool Runtime::anyExecutorHoldsGather(DsId id) const {
  for (const auto& kv : executors_) {
    if (kv.second->holdsGather(id)) return true;
  }
  return false;
}

void Runtime::startBackward(bool update_step) {
  checkCommunicators("the start of a backward");
  // A backward after an update step opens a new accumulation window: the first reduction of
  // each parameter in it overwrites the target, later ones (micro-steps, other graphs) add.
  if (window_closed_) {
    registry_.forEach([](DSParam& p) {
      p.has_acc_grad = false;
      p.reduce_count = 0;
    });
  }
  window_closed_ = update_step;
  update_step_ = update_step;
}

void Runtime::endBackward(GraphId graph_id, bool release_reduce_buckets) {
  CustomOpExecutor& ex = executor(graph_id, "end_backward");
  if (profiling_) return;
  checkCommunicators("the end of a backward");
  // Reductions queued by any graph are flushed, so no graph's slots outlive a bucket swap.
  reducer().flushAll();
  // The optimizer reads the targets right after backward, on the compute stream: that stream
  // waits for the reduce lane on the device. The host does not block (DeepSpeed's flush does),
  // so it can queue the optimizer step while the last reductions run.
  lanes().record(Lane::ReduceScatter)->blockStream(lanes().computeStream());
  ex.endBackward(update_step_);
  if (release_reduce_buckets) reducer().releaseBuckets();
}

namespace {
// Registering an id again replaces its entry; a reduction queued for the old entry would be
// flushed into the new one's layout and target (of another size, or another stage's).
std::string pendingReductionError(DsId id) {
  return "ds id " + std::to_string(id) +
         " has a gradient reduction queued that has not been flushed; registering it again now would send that "
         "gradient into the new registration's target. Finish the backward (end_backward) first";
}
}  // namespace

void Runtime::registerZ3Params(std::vector<Z3ParamSpec> specs) {
  const int world = comm_->size();
  // Local validation first; the verdict is exchanged so that a bad shard on one rank makes every
  // rank raise (instead of the others hanging in, or corrupting, a later collective).
  int64_t bad_index = -1;
  int64_t bad_numel = 0;
  std::string local_error;
  std::unordered_set<DsId> seen;
  for (size_t i = 0; i < specs.size() && bad_index < 0; ++i) {
    const Z3ParamSpec& s = specs[i];
    const int64_t ppr = ceilDiv(numelOf(s.shape), world);
    if (!seen.insert(s.id).second) {
      local_error = "ds id " + std::to_string(s.id) + " appears twice in one registration";
    } else if (reducer_->hasPending(s.id)) {
      local_error = pendingReductionError(s.id);
    } else if (!s.shard.defined() || s.shard.numel() != ppr) {
      bad_numel = s.shard.defined() ? s.shard.numel() : -1;
      local_error = "shard of ds id " + std::to_string(s.id) + " has " + std::to_string(bad_numel) +
                    " elements, expected ceil(numel / world) = " + std::to_string(ppr);
    } else if (!sameDevice(s.shard.device(), device())) {
      local_error = "shard of ds id " + std::to_string(s.id) + " is on " + s.shard.device().str() +
                    ", not on the runtime's device " + device().str();
    } else if (s.grad_target.defined() && s.grad_target.numel() != 0 && !sameDevice(s.grad_target.device(), device())) {
      local_error = "gradient target of ds id " + std::to_string(s.id) + " is on " + s.grad_target.device().str() +
                    ", not on the runtime's device " + device().str();
    } else if (s.grad_target.defined() && s.grad_target.numel() != 0 &&
               (s.grad_target.numel() != ppr || !s.grad_target.is_contiguous())) {
      local_error = "gradient target of ds id " + std::to_string(s.id) + " has " +
                    std::to_string(s.grad_target.numel()) + " elements (or is not contiguous), expected " +
                    std::to_string(ppr);
    } else if (s.gather_dtype.has_value() && !at::isFloatingType(*s.gather_dtype)) {
      local_error = "gather dtype of ds id " + std::to_string(s.id) + " is " + c10::toString(*s.gather_dtype) +
                    "; it must be a floating-point dtype (the dtype the full parameter is computed in)";
    } else if (!comm_->carries(s.gather_dtype.value_or(s.shard.scalar_type())) ||
               (secondary_comm_ && !secondary_comm_->carries(s.gather_dtype.value_or(s.shard.scalar_type())))) {
      local_error = "gather dtype of ds id " + std::to_string(s.id) + " is " +
                    c10::toString(s.gather_dtype.value_or(s.shard.scalar_type())) + ", which the " + comm_->name() +
                    " communicator cannot carry (float32, float16, bfloat16 or float64)";
    } else if (s.gather_dtype.has_value() && *s.gather_dtype != s.shard.scalar_type() &&
               !at::isFloatingType(s.shard.scalar_type())) {
      local_error = "shard of ds id " + std::to_string(s.id) + " is stored as " +
                    c10::toString(s.shard.scalar_type()) + " and cannot be gathered as " +
                    c10::toString(*s.gather_dtype) + ": only a floating-point shard may differ from its gather dtype";
    }
    if (!local_error.empty()) bad_index = static_cast<int64_t>(i);
  }
  const std::vector<int64_t> all =
      comm_->allGatherInts({static_cast<int64_t>(specs.size()), bad_index});
  for (int r = 0; r < world; ++r) {
    TORCH_CHECK(all[2 * r] == static_cast<int64_t>(specs.size()), "deepcompile: ZeRO-3 registration: rank ", r,
                " registers ", all[2 * r], " parameters in this call, rank ", comm_->rank(), " registers ",
                specs.size());
  }
  TORCH_CHECK(local_error.empty(), "deepcompile: ZeRO-3 registration error on rank ", comm_->rank(), ": ",
              local_error);
  for (int r = 0; r < world; ++r) {
    TORCH_CHECK(all[2 * r + 1] < 0, "deepcompile: ZeRO-3 registration error on rank ", r, " (parameter #",
                all[2 * r + 1], " of the batch, ds id ", specs.at(all[2 * r + 1]).id,
                "): its shard size, device, gradient target or gather dtype was rejected there; no parameter of "
                "this batch was registered");
  }
  // Every rank must register the same parameters: the same ids, in the same order, with the same
  // sizes and gather dtypes. A difference (a rank that built another model, or another precision)
  // otherwise shows up only later, as gathers of mismatched sizes that hang or corrupt memory.
  std::vector<int64_t> mine;
  mine.reserve(3 * specs.size());
  for (const Z3ParamSpec& s : specs) {
    mine.push_back(s.id);
    mine.push_back(numelOf(s.shape));
    mine.push_back(static_cast<int64_t>(s.gather_dtype.value_or(s.shard.scalar_type())));
  }
  const std::vector<int64_t> everyone = comm_->allGatherInts(mine);
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < specs.size(); ++i) {
      const int64_t* theirs = everyone.data() + r * mine.size() + 3 * i;
      TORCH_CHECK(theirs[0] == mine[3 * i] && theirs[1] == mine[3 * i + 1] && theirs[2] == mine[3 * i + 2],
                  "deepcompile: ZeRO-3 registration: parameter #", i, " of the batch differs between ranks: rank ",
                  comm_->rank(), " registers ds id ", mine[3 * i], " with ", mine[3 * i + 1], " elements gathered as ",
                  static_cast<at::ScalarType>(mine[3 * i + 2]), ", rank ", r, " ds id ", theirs[0], " with ",
                  theirs[1], " elements gathered as ", static_cast<at::ScalarType>(theirs[2]),
                  " (every rank must build the same model in the same precision); no parameter of this batch was "
                  "registered");
    }
  }
  for (Z3ParamSpec& s : specs) {
    freeGatheredOf(s.id);
    Z3Layout layout;
    layout.shard = s.shard;
    layout.gather_dtype = s.gather_dtype.value_or(s.shard.scalar_type());
    layout.persistent = s.persistent;
    DSParam p(s.id, s.shape, world, std::move(layout));
    // hpZ: the secondary copy exists from registration on, so planners measure it as resident.
    if (secondary_comm_) provideSecondary(*lanes_, *secondary_comm_, p.z3("register_z3_params"), !s.persistent);
    p.expected_grad_dtype = s.expected_grad_dtype;
    if (s.grad_target.defined() && s.grad_target.numel() != 0) {
      p.grad_target = s.grad_target;
      p.grad_target.zero_();
    }
    // A persistent parameter is not gathered at registration: it is gathered on first use and
    // then kept (registering the shard itself as "gathered" breaks the second gather).
    registry_.add(std::move(p));
  }
}

void Runtime::registerZ12Param(DsId id, std::vector<int64_t> shape, at::Tensor param, int64_t group_offset,
                               int64_t partition_numel) {
  const int64_t numel = numelOf(shape);
  TORCH_CHECK(param.defined() && param.numel() == numel, "deepcompile: register_z12_param: ds id ", id,
              ": parameter has ", param.defined() ? param.numel() : -1, " elements, shape says ", numel);
  TORCH_CHECK(group_offset >= 0 && partition_numel >= 0 &&
                  group_offset + numel <= partition_numel * static_cast<int64_t>(comm_->size()),
              "deepcompile: register_z12_param: ds id ", id, " at offset ", group_offset, " with ", numel,
              " elements does not fit in ", comm_->size(), " partitions of ", partition_numel, " elements");
  checkDevice(param, "register_z12_param", "the parameter");
  TORCH_CHECK(!reducer_->hasPending(id), "deepcompile: register_z12_param: ", pendingReductionError(id));
  freeGatheredOf(id);
  Z12Layout layout;
  layout.param = std::move(param);
  layout.group_offset = group_offset;
  layout.partition_numel = partition_numel;
  registry_.add(DSParam(id, std::move(shape), comm_->size(), std::move(layout)));
}

void Runtime::bindGradTarget(DsId id, at::Tensor target, bool zero) {
  DSParam& p = registry_.get(id);
  const int64_t expected = p.localGradNumel(comm_->rank());
  TORCH_CHECK(target.defined() && target.numel() == expected, "deepcompile: bind_grad_target: ds id ", id,
              " needs a target of ", expected, " elements on rank ", comm_->rank(), ", got ",
              target.defined() ? target.numel() : -1);
  TORCH_CHECK(target.is_contiguous(), "deepcompile: bind_grad_target: the target of ds id ", id,
              " must be contiguous (collectives write into it directly)");
  checkDevice(target, "bind_grad_target", "the gradient target");
  if (zero) target.zero_();
  p.grad_target = std::move(target);
  p.has_acc_grad = false;
}

void Runtime::unbindGradTargets(const std::optional<std::vector<DsId>>& ids) {
  TORCH_CHECK(reducer_->pendingTasks() == 0, "deepcompile: cannot unbind gradient targets while ",
              reducer_->pendingTasks(), " reductions are pending (end_backward first)");
  if (ids.has_value()) {
    for (DsId id : *ids) registry_.get(id).grad_target = at::Tensor();
  } else {
    registry_.forEach([](DSParam& p) { p.grad_target = at::Tensor(); });
  }
}

void Runtime::setPersistent(DsId id, bool persistent) {
  Z3Layout& z3 = registry_.get(id).z3("deepcompile: set_persistent");
  z3.persistent = persistent;
  // hpZ: a persistent parameter stays gathered between steps and never reads a secondary copy.
  if (secondary_comm_) provideSecondary(*lanes_, *secondary_comm_, z3, !persistent);
  if (persistent) {
    // Gather now, in the gather dtype (what its uses ask for, so they need no conversion):
    // allocating persistent buffers early limits fragmentation.
    if (!z3.isGathered()) launchGathers(*lanes_, *comm_, {&z3}, {z3.gather_dtype}, secondary_comm_.get());
  } else if (!anyExecutorHoldsGather(id)) {
    freeGathered(*lanes_, z3);
  }
}

void Runtime::setHostShard(DsId id, const std::optional<at::Tensor>& host, bool host_pinned) {
  Z3Layout& z3 = registry_.get(id).z3("deepcompile: set_host_shard");
  if (!host.has_value() || !host->defined()) {
    z3.host_shard = at::Tensor();
    return;
  }
  const at::Tensor& h = *host;
  TORCH_CHECK(h.device().is_cpu(), "deepcompile: set_host_shard: the host shard of ds id ", id, " is on ", h.device(),
              "; it must be a CPU tensor");
  TORCH_CHECK(h.scalar_type() == z3.shard.scalar_type() && h.numel() == z3.shard.numel(),
              "deepcompile: set_host_shard: the host shard of ds id ", id, " is ", c10::toString(h.scalar_type()),
              " with ", h.numel(), " elements; the shard is ", c10::toString(z3.shard.scalar_type()), " with ",
              z3.shard.numel(), " elements");
  TORCH_CHECK(h.is_contiguous(), "deepcompile: set_host_shard: the host shard of ds id ", id, " must be contiguous");
  // Warned, not refused: offload with pin_memory off (offload_optimizer.pin_memory false, for
  // hosts that cannot lock that much memory) hands pageable shards here on purpose.
  if (hostShardCopiesBlock(device(), host_pinned) && !warned_pageable_host_shard_) {
    warned_pageable_host_shard_ = true;
    TORCH_WARN("deepcompile: set_host_shard: the host shard of ds id ", id,
                    " is in pageable (not page-locked) host memory, so every gather of an offloaded parameter "
                    "copies it to ", device(), " synchronously: the host blocks and the gather overlaps nothing. "
                    "Use pinned host memory (offload pin_memory true) unless the host cannot lock that much memory. "
                    "(Warned once per runtime.)");
  }
  z3.host_shard = h.view(z3.shard.sizes());
}

void Runtime::invalidateGathered(DsId id) { forgetGathered(registry_.get(id).z3("deepcompile: invalidate_gathered_param")); }

void Runtime::forgetGathered(Z3Layout& z3) {
  z3.secondary_valid = false;
  if (z3.persistent) return;
  if (z3.gather_done) z3.gather_done->hostWait();
  z3.gathered = at::Tensor();
  z3.valid = false;
  z3.gather_done = nullptr;
}

void Runtime::clearAllGathered() {
  registry_.forEachZ3([this](DSParam&, Z3Layout& z3) { forgetGathered(z3); });
}

void Runtime::invalidateAllGathered() {
  registry_.forEachZ3([this](DSParam& p, Z3Layout& z3) {
    z3.secondary_valid = false;  // the shards changed: so did what the secondary copy must hold
    if (z3.persistent) {
      z3.valid = false;  // keep the buffer; the next gather refills it
    } else if (z3.gathered.defined() && !anyExecutorHoldsGather(p.id)) {
      freeGathered(*lanes_, z3);
    }
  });
}

int64_t Runtime::secondaryBytes() {
  int64_t total = 0;
  registry_.forEachZ3([&total](DSParam&, Z3Layout& z3) {
    if (z3.secondary.defined()) total += z3.secondary.numel() * static_cast<int64_t>(z3.secondary.element_size());
  });
  return total;
}

void Runtime::freeGatheredOf(DsId id) {
  DSParam* old = registry_.find(id);
  if (old == nullptr) return;
  if (Z3Layout* z3 = old->maybeZ3()) freeGathered(*lanes_, *z3);
}

std::recursive_timed_mutex& runtimeMutex() { return *runtimeMutexPtr(); }

std::unique_lock<std::recursive_timed_mutex> lockRuntime() {
  return std::unique_lock<std::recursive_timed_mutex>(runtimeMutex());
}

Runtime& currentRuntime() {
  auto& slot = currentSlot();
  TORCH_CHECK(slot != nullptr,
              "deepcompile runtime is not initialized: call deepcompile.runtime.init(process_group, ...) first");
  return *slot;
}

bool runtimeInitialized() { return currentSlot() != nullptr; }

void installRuntime(std::unique_ptr<Runtime> runtime) {
  auto lock = lockRuntime();
  destroyRuntime();
  currentSlot() = std::move(runtime);
  publishedRuntime().store(currentSlot().get());
}

void destroyRuntime(double timeout_s) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto budget = std::chrono::duration<double>(std::max(timeout_s, 0.0));
  std::unique_lock<std::recursive_timed_mutex> lock(runtimeMutex(), std::defer_lock);
  if (!lock.try_lock_for(budget)) {
    // Another thread is inside an op or a control call past the deadline: a collective whose
    // peers are gone. Aborting the communicators (the one call meant to come from another thread:
    // ncclCommAbort) ends it; that thread then raises and lets go of the lock.
    if (Runtime* held = publishedRuntime().load()) held->abortCommunicators();
    if (!lock.try_lock_for(std::chrono::duration<double>(kLockGraceAfterAbortS))) {
      TORCH_WARN("deepcompile: the runtime was still in use by another thread ", kLockGraceAfterAbortS,
                 " s after its communicators were aborted at the shutdown deadline (", timeout_s,
                 " s); it is left in place, unusable, instead of being freed under that thread");
      return;
    }
  }
  const double left = std::max(0.0, timeout_s - std::chrono::duration<double>(Clock::now() - start).count());
  // The slot is emptied first, whatever the shutdown hits: a runtime that failed to shut down
  // once used to stay installed, and every later cleanup() and init() raised its error again.
  std::unique_ptr<Runtime> runtime = std::move(currentSlot());
  currentSlot() = nullptr;
  publishedRuntime().store(nullptr);
  if (!runtime) return;
  const std::string error = runtime->shutdown(left);
  runtime.reset();
  if (!error.empty()) {
    TORCH_WARN("deepcompile: the runtime was shut down after an error (", error,
               "); its state is released and deepcompile.runtime.init() can be called again");
  }
}

}  // namespace deepcompile
