#include <deepcompile/registry.h>

#include <algorithm>

namespace deepcompile {

std::vector<OwnedRange> DSParam::ownedRanges() const {
  std::vector<OwnedRange> ranges;
  if (partitioned) {
    for (int r = 0; r < world; ++r) {
      ranges.push_back({r, r * ppr, (r + 1) * ppr});
    }
    return ranges;
  }
  for (int r = 0; r < world; ++r) {
    const int64_t begin = std::max(group_offset, r * partition_numel);
    const int64_t end = std::min(group_offset + numel, (r + 1) * partition_numel);
    if (end > begin) ranges.push_back({r, begin - group_offset, end - group_offset});
  }
  return ranges;
}

int64_t DSParam::localGradNumel(int rank) const {
  if (partitioned) return ppr;
  for (const auto& range : ownedRanges()) {
    if (range.owner == rank) return range.numel();
  }
  return 0;
}

int64_t DSParam::localGradOffset(int rank) const {
  for (const auto& range : ownedRanges()) {
    if (range.owner == rank) return range.begin;
  }
  return 0;
}

at::Tensor DSParam::gatheredView() const {
  TORCH_INTERNAL_ASSERT(gathered.defined());
  return gathered.narrow(0, 0, numel).view(shape);
}

void DSParamRegistry::add(DSParam param) {
  const DsId id = param.id;
  params_.erase(id);
  params_.emplace(id, std::move(param));
}

DSParam& DSParamRegistry::get(DsId id) {
  auto it = params_.find(id);
  TORCH_CHECK(it != params_.end(), "deepcompile: unknown ds id ", id, ": no parameter with this id is registered");
  return it->second;
}

const DSParam& DSParamRegistry::get(DsId id) const { return const_cast<DSParamRegistry*>(this)->get(id); }

}  // namespace deepcompile
