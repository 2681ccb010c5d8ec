// DSParam and DSParamRegistry: what the runtime knows about each parameter, keyed by ds id.
// The registry is the single owner of per-parameter state that several graphs share: the
// gathered buffer and its gather completion (so every graph waits on the same gather), and
// the gradient-accumulation state of the current window (so a parameter reduced by two graphs
// in one backward accumulates instead of overwriting).
//
// A DSParam is a common core (identity, shape, gradient target and window state: what the
// reducer needs in every stage) plus exactly one stage layout, Z3Layout or Z12Layout. The layout
// is fixed when the parameter is constructed; the accessors z3() and z12() raise a clear error
// ("ds id 7 is registered for ZeRO-1/2, not ZeRO-3") instead of reading the other stage's fields.
#pragma once

#include <deepcompile/common.h>

#include <optional>
#include <unordered_map>
#include <variant>
#include <vector>

namespace deepcompile {

// A contiguous range [begin, end) of a flattened parameter that rank `owner` receives.
struct OwnedRange {
  int owner;
  int64_t begin;
  int64_t end;
  int64_t numel() const { return end - begin; }
};

// The two parameter layouts: ZeRO-1 and ZeRO-2 lay parameters out alike (they differ only in
// when gradients are reduced, which is the executor's business).
enum class ParamStage { Zero12, Zero3 };
const char* paramStageName(ParamStage stage);  // "ZeRO-1/2", "ZeRO-3"

// Number of elements of a parameter of `shape`; rejects negative dimensions.
int64_t numelOf(const std::vector<int64_t>& shape);

// ZeRO-3: each rank holds a shard of the flattened parameter, zero-padded to world * ppr
// elements, and gathers the full parameter into a runtime-owned buffer around its uses.
struct Z3Layout {
  // This rank's `ppr` elements of the flattened, padded parameter: what gathers send.
  at::Tensor shard;
  // Elements per rank, ceil(numel / world), and the padded size world * ppr. Both are derived
  // from the core's shape and world by DSParam's constructor.
  int64_t ppr = 0;
  int64_t padded_numel = 0;
  // The dtype the full parameter is gathered in when no dtype is requested: the module
  // parameter's dtype, what graphs and eager frames compute with. It may differ from the
  // storage dtype of `shard`: a trainable parameter's shard is its fp32 master copy, and a bf16
  // model gathers it as bf16 (the cast is done on the sending side, fused into the gather).
  // The parameter's value is `shard` rounded to this dtype; other dtypes are casts of that value.
  at::ScalarType gather_dtype = at::ScalarType::Undefined;
  bool persistent = false;  // never freed by release_param
  // The parameter's id (set by DSParam's constructor), for error messages of the gather path.
  DsId ds_id = -1;
  // Parameter offload: a host copy of `shard` (a CPU tensor of the same dtype and shape, pinned
  // on a GPU runtime). While it is set it holds the parameter's value and every gather reads it,
  // copying it to the device on the all-gather lane first, whatever `shard` holds: the device
  // storage may be freed or still being reloaded. Unset: gathers read `shard`, which must then
  // have its storage (an empty one raises instead of reading freed memory).
  at::Tensor host_shard;

  // Gather state: the flat padded buffer, whether it holds (or will hold, once `gather_done`
  // completes) the current parameter, and the gather's completion.
  at::Tensor gathered;
  bool valid = false;
  CompletionPtr gather_done;

  // hpZ (ZeRO++'s secondary partition; runtime.h): this rank's chunk of the gathered parameter
  // within its secondary group, `padded_numel / secondary size` elements in the gather dtype.
  // Allocated at registration for a parameter that is not persistent (so every planner sees it as
  // resident memory), refilled from the gathered buffer when a use releases it, and marked stale
  // by every invalidation (the shards changed). While `secondary_valid`, gathers read it over
  // the secondary communicator instead of the shard over the whole group.
  at::Tensor secondary;
  bool secondary_valid = false;

  bool isGathered() const { return valid && gathered.defined(); }
};

// ZeRO-1/2: every rank holds the whole parameter; its gradient is reduced to the ranks that own
// its pieces of the flat vector of its parameter group.
struct Z12Layout {
  at::Tensor param;  // the replicated parameter
  // The parameter occupies [group_offset, group_offset + numel) of its group's flat vector, of
  // which each rank owns `partition_numel` consecutive elements.
  int64_t group_offset = 0;
  int64_t partition_numel = 0;
  // ZeRO-1: the full local gradient accumulated over the micro-steps of a window.
  at::Tensor local_grad_acc;
};

class DSParam {
 public:
  // The core is derived from (id, shape, world); the layout decides the stage for good.
  DSParam(DsId id, std::vector<int64_t> shape, int world, Z3Layout layout);
  DSParam(DsId id, std::vector<int64_t> shape, int world, Z12Layout layout);

  // ---- The common core: what every stage has.
  DsId id;
  std::vector<int64_t> shape;  // full, unpartitioned shape
  int64_t numel;               // product of shape
  int world;                   // ranks the parameter (ZeRO-3) or its group's vector (ZeRO-1/2) is split over

  // Cast gradients to this dtype before bucketing (unset: reduce in the gradient's own dtype).
  std::optional<at::ScalarType> expected_grad_dtype;
  // Where this rank's part of the averaged gradient goes (undefined = not bound).
  at::Tensor grad_target;
  // True once a reduction wrote the target in the current accumulation window.
  bool has_acc_grad = false;
  // Gradients reduce_grad accepted for this parameter in the current accumulation window (reset
  // with has_acc_grad when a window opens, not when a target is bound): a debug view of how
  // many graphs and micro-steps contributed, read through reduce_counts().
  int64_t reduce_count = 0;

  // ---- The stage layout.
  ParamStage stage() const { return std::holds_alternative<Z3Layout>(layout_) ? ParamStage::Zero3 : ParamStage::Zero12; }
  bool isZ3() const { return stage() == ParamStage::Zero3; }
  // The layout of the given stage. `context` starts the error raised when the parameter has the
  // other layout (e.g. "dc.allgather_param").
  Z3Layout& z3(const char* context = "deepcompile");
  const Z3Layout& z3(const char* context = "deepcompile") const;
  Z12Layout& z12(const char* context = "deepcompile");
  const Z12Layout& z12(const char* context = "deepcompile") const;
  // The layout of the given stage, or nullptr: for code that handles both stages.
  Z3Layout* maybeZ3() { return std::get_if<Z3Layout>(&layout_); }
  const Z3Layout* maybeZ3() const { return std::get_if<Z3Layout>(&layout_); }
  Z12Layout* maybeZ12() { return std::get_if<Z12Layout>(&layout_); }
  const Z12Layout* maybeZ12() const { return std::get_if<Z12Layout>(&layout_); }
  // "ds id 7 is registered for ZeRO-1/2, not ZeRO-3": the error text of a wrong-stage access.
  std::string stageMismatch(ParamStage wanted) const;

  // ---- Gradient partitioning, in both stages.
  // The pieces of this parameter each rank receives (ZeRO-3: every rank its padded shard;
  // ZeRO-1/2: the overlaps with the partitions, empty pieces omitted).
  std::vector<OwnedRange> ownedRanges() const;
  // Number of elements of the gradient this rank receives (ZeRO-3: ppr).
  int64_t localGradNumel(int rank) const;
  // Offset of this rank's piece inside the flattened parameter.
  int64_t localGradOffset(int rank) const;

  // ---- ZeRO-3 only (a ZeRO-1/2 parameter raises).
  // The full parameter as a view of the gathered buffer.
  at::Tensor gatheredView() const;

 private:
  std::variant<Z3Layout, Z12Layout> layout_;
};

class DSParamRegistry {
 public:
  // Adds or replaces the entry (a replaced entry's state is dropped entirely).
  void add(DSParam param);
  bool contains(DsId id) const { return params_.count(id) != 0; }
  // Throws a clear error for ids that were never registered.
  DSParam& get(DsId id);
  const DSParam& get(DsId id) const;
  // nullptr for ids that were never registered.
  DSParam* find(DsId id);
  size_t size() const { return params_.size(); }
  void clear() { params_.clear(); }

  template <typename F>
  void forEach(F&& f) {
    for (auto& kv : params_) f(kv.second);
  }
  // Visits the ZeRO-3 parameters only, with their core and their layout.
  template <typename F>
  void forEachZ3(F&& f) {
    for (auto& kv : params_) {
      if (Z3Layout* z3 = kv.second.maybeZ3()) f(kv.second, *z3);
    }
  }

 private:
  std::unordered_map<DsId, DSParam> params_;
};

}  // namespace deepcompile
