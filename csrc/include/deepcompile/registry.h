// DSParam and DSParamRegistry: what the runtime knows about each parameter, keyed by ds id.
// The registry is the single owner of per-parameter state that several graphs share: the
// gathered buffer and its gather completion (so every graph waits on the same gather), and
// the gradient-accumulation state of the current window (so a parameter reduced by two graphs
// in one backward accumulates instead of overwriting).
#pragma once

#include <deepcompile/common.h>

#include <optional>
#include <unordered_map>
#include <vector>

namespace deepcompile {

// A contiguous range [begin, end) of a flattened parameter that rank `owner` receives.
struct OwnedRange {
  int owner;
  int64_t begin;
  int64_t end;
  int64_t numel() const { return end - begin; }
};

struct DSParam {
  DsId id = -1;
  std::vector<int64_t> shape;  // full, unpartitioned shape
  int64_t numel = 0;           // product of shape
  int world = 1;

  // ZeRO-3: `data` is this rank's shard of `ppr` elements of the flattened, padded parameter.
  // ZeRO-1/2: `data` is the replicated parameter; it occupies [group_offset, group_offset +
  // numel) of its group's flat vector, of which each rank owns `partition_numel` elements.
  bool partitioned = false;
  at::Tensor data;
  int64_t ppr = 0;
  int64_t group_offset = 0;
  int64_t partition_numel = 0;

  // ZeRO-3: the dtype the full parameter is gathered in when no dtype is requested: the module
  // parameter's dtype, what graphs and eager frames compute with. It may differ from the
  // storage dtype of `data`: a trainable parameter's shard is its fp32 master copy, and a bf16
  // model gathers it as bf16 (the cast is done on the sending side, fused into the gather).
  // The parameter's value is `data` rounded to this dtype; other dtypes are casts of that value.
  at::ScalarType gather_dtype = at::ScalarType::Undefined;
  std::optional<at::ScalarType> expected_grad_dtype;  // cast gradients to this before bucketing
  bool persistent = false;                           // never freed by release_param

  // Where this rank's part of the averaged gradient goes (undefined = not bound).
  at::Tensor grad_target;
  // True once a reduction wrote the target in the current accumulation window.
  bool has_acc_grad = false;
  // Gradients reduce_grad accepted for this parameter in the current accumulation window (reset
  // with has_acc_grad when a window opens, not when a target is bound): a debug view of how
  // many graphs and micro-steps contributed, read through reduce_counts().
  int64_t reduce_count = 0;
  // ZeRO-1: full local gradient accumulated over the micro-steps of a window.
  at::Tensor local_grad_acc;

  // ZeRO-3 gather state: flat padded buffer, whether it holds (or will hold, once
  // `gather_done` completes) the current parameter, and the gather's completion.
  at::Tensor gathered;
  bool valid = false;
  CompletionPtr gather_done;

  int64_t paddedNumel() const { return ppr * world; }
  // ZeRO-1/2: the pieces of this parameter each rank owns (empty pieces omitted).
  std::vector<OwnedRange> ownedRanges() const;
  // Number of elements of the gradient this rank receives (ZeRO-3: ppr).
  int64_t localGradNumel(int rank) const;
  // ZeRO-1/2: offset of this rank's piece inside the flattened parameter.
  int64_t localGradOffset(int rank) const;
  // The full parameter as a view of `gathered`.
  at::Tensor gatheredView() const;
};

class DSParamRegistry {
 public:
  // Adds or replaces the entry (a replaced entry's state is dropped entirely).
  void add(DSParam param);
  bool contains(DsId id) const { return params_.count(id) != 0; }
  // Throws a clear error for ids that were never registered.
  DSParam& get(DsId id);
  const DSParam& get(DsId id) const;
  size_t size() const { return params_.size(); }
  void clear() { params_.clear(); }

  template <typename F>
  void forEach(F&& f) {
    for (auto& kv : params_) f(kv.second);
  }

 private:
  std::unordered_map<DsId, DSParam> params_;
};

}  // namespace deepcompile
