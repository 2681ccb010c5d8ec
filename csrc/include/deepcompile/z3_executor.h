// The ZeRO-3 executor: the gather, prefetch, wait and release ops of one graph, on top of the
// gradient reduction every executor does.
#pragma once

#include <deepcompile/executor.h>

#include <optional>
#include <unordered_map>

namespace deepcompile {

class Z3Executor : public CustomOpExecutor {
 public:
  Z3Executor(ExecutorContext context, GraphId graph_id, std::vector<DsId> ids)
      : CustomOpExecutor(std::move(context), graph_id, std::move(ids), 3) {}

  at::Tensor allgather(DsId id, std::optional<at::ScalarType> dtype);
  void prefetch(const std::vector<DsId>& ids, const std::vector<at::ScalarType>& dtypes);
  void wait(DsId id);
  void release(DsId id, int64_t n_users);
  void endBackward(bool update_step) override;
  bool holdsGather(DsId id) const override;
  // A failed step's uses never reach their releases: without this, the next step's first
  // release of such a parameter would count on from the old episode and free its buffer early.
  void abortStep() override { releases_.clear(); }

 private:
  struct ReleaseCount {
    int64_t remaining = 0;
    int64_t n_users = 0;
  };
  std::unordered_map<DsId, ReleaseCount> releases_;
};

}  // namespace deepcompile
