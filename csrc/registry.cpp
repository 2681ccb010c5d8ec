#include <deepcompile/registry.h>

#include <algorithm>
#include <string>

namespace deepcompile {

const char* paramStageName(ParamStage stage) { return stage == ParamStage::Zero3 ? "ZeRO-3" : "ZeRO-1/2"; }

int64_t numelOf(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    TORCH_CHECK(d >= 0, "deepcompile: negative dimension in parameter shape");
    n *= d;
  }
  return n;
}

DSParam::DSParam(DsId id_, std::vector<int64_t> shape_, int world_, Z3Layout layout)
    : id(id_), shape(std::move(shape_)), numel(numelOf(shape)), world(world_) {
  TORCH_CHECK(world >= 1, "deepcompile: ds id ", id, ": world size must be >= 1, got ", world);
  layout.ppr = ceilDiv(numel, world);
  layout.padded_numel = layout.ppr * world;
  layout.ds_id = id;
  layout_ = std::move(layout);
}

DSParam::DSParam(DsId id_, std::vector<int64_t> shape_, int world_, Z12Layout layout)
    : id(id_), shape(std::move(shape_)), numel(numelOf(shape)), world(world_), layout_(std::move(layout)) {
  TORCH_CHECK(world >= 1, "deepcompile: ds id ", id, ": world size must be >= 1, got ", world);
}

std::string DSParam::stageMismatch(ParamStage wanted) const {
  return "ds id " + std::to_string(id) + " is registered for " + paramStageName(stage()) + ", not " +
         paramStageName(wanted);
}

Z3Layout& DSParam::z3(const char* context) {
  Z3Layout* layout = maybeZ3();
  TORCH_CHECK(layout != nullptr, context, ": ", stageMismatch(ParamStage::Zero3));
  return *layout;
}

const Z3Layout& DSParam::z3(const char* context) const { return const_cast<DSParam*>(this)->z3(context); }

Z12Layout& DSParam::z12(const char* context) {
  Z12Layout* layout = maybeZ12();
  TORCH_CHECK(layout != nullptr, context, ": ", stageMismatch(ParamStage::Zero12));
  return *layout;
}

const Z12Layout& DSParam::z12(const char* context) const { return const_cast<DSParam*>(this)->z12(context); }

std::vector<OwnedRange> DSParam::ownedRanges() const {
  std::vector<OwnedRange> ranges;
  if (const Z3Layout* z3 = maybeZ3()) {
    for (int r = 0; r < world; ++r) ranges.push_back({r, r * z3->ppr, (r + 1) * z3->ppr});
    return ranges;
  }
  const Z12Layout& z12 = std::get<Z12Layout>(layout_);
  for (int r = 0; r < world; ++r) {
    const int64_t begin = std::max(z12.group_offset, r * z12.partition_numel);
    const int64_t end = std::min(z12.group_offset + numel, (r + 1) * z12.partition_numel);
    if (end > begin) ranges.push_back({r, begin - z12.group_offset, end - z12.group_offset});
  }
  return ranges;
}

int64_t DSParam::localGradNumel(int rank) const {
  if (const Z3Layout* z3 = maybeZ3()) return z3->ppr;
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
  const Z3Layout& layout = z3("deepcompile: gathered view");
  TORCH_INTERNAL_ASSERT(layout.gathered.defined());
  return layout.gathered.narrow(0, 0, numel).view(shape);
}

void DSParamRegistry::add(DSParam param) {
  const DsId id = param.id;
  params_.erase(id);
  params_.emplace(id, std::move(param));
}

DSParam& DSParamRegistry::get(DsId id) {
  DSParam* param = find(id);
  TORCH_CHECK(param != nullptr, "deepcompile: unknown ds id ", id, ": no parameter with this id is registered");
  return *param;
}

const DSParam& DSParamRegistry::get(DsId id) const { return const_cast<DSParamRegistry*>(this)->get(id); }

DSParam* DSParamRegistry::find(DsId id) {
  auto it = params_.find(id);
  return it == params_.end() ? nullptr : &it->second;
}

}  // namespace deepcompile
