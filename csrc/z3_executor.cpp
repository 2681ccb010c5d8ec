// ZeRO-3: gathering parameters before use and freeing them after their last use.
#include <deepcompile/gather.h>
#include <deepcompile/lanes.h>
#include <deepcompile/z3_executor.h>

#include <algorithm>

namespace deepcompile {

at::Tensor Z3Executor::allgather(DsId id, std::optional<at::ScalarType> dtype) {
  DSParam& p = param(id, "allgather_param");
  Z3Layout& z3 = p.z3("dc.allgather_param");
  const at::ScalarType target = dtype.value_or(z3.gather_dtype);
  if (!z3.isGathered()) {
    launchGathers(ctx_.lanes, ctx_.comm, {&z3}, {target}, ctx_.secondary_comm);
    return p.gatheredView();
  }
  // Prefetches and persistent gathers land in the gather dtype, which is also what a request
  // without a dtype asks for: the normal path returns the buffer without any conversion.
  if (z3.gathered.scalar_type() == target) return p.gatheredView();
  if (z3.gathered.scalar_type() == z3.gather_dtype) {
    // Valid in the gather dtype, another one requested (e.g. a fused cast of a persistent
    // parameter): the buffer holds the parameter's exact values, so converting gives what a
    // fresh gather would, but only after the gather landed.
    if (z3.gather_done) z3.gather_done->blockStream(ctx_.lanes.computeStream());
    return p.gatheredView().to(target);
  }
  // Valid only in a narrower dtype: converting back would lose precision. Gather a private
  // copy in the requested dtype; the registered buffer is left to its own release.
  return gatherPrivateCopy(ctx_.lanes, ctx_.comm, z3, target).narrow(0, 0, p.numel).view(p.shape);
}

void Z3Executor::prefetch(const std::vector<DsId>& ids, const std::vector<at::ScalarType>& dtypes) {
  std::vector<Z3Layout*> todo;
  std::vector<at::ScalarType> todo_dtypes;
  for (size_t i = 0; i < ids.size(); ++i) {
    Z3Layout& z3 = param(ids[i], "prefetch_params_fused").z3("dc.prefetch_params_fused");
    if (z3.isGathered()) continue;
    // An id named twice in one prefetch is gathered once (twice in one group, both gathers would
    // write one buffer); it must ask for one dtype.
    const auto earlier = std::find(todo.begin(), todo.end(), &z3);
    if (earlier != todo.end()) {
      TORCH_CHECK(todo_dtypes[earlier - todo.begin()] == dtypes[i], "dc.prefetch_params_fused: ds id ", ids[i],
                  " appears twice with different dtypes (", todo_dtypes[earlier - todo.begin()], " and ", dtypes[i],
                  ")");
      continue;
    }
    todo.push_back(&z3);
    todo_dtypes.push_back(dtypes[i]);
  }
  launchGathers(ctx_.lanes, ctx_.comm, todo, todo_dtypes, ctx_.secondary_comm);
}

void Z3Executor::wait(DsId id) {
  Z3Layout& z3 = param(id, "wait_allgather").z3("dc.wait_allgather");
  TORCH_CHECK(z3.isGathered(), "dc.wait_allgather: ds id ", id,
              " is not gathered (no allgather_param or prefetch issued since its last release)");
  if (z3.gather_done) z3.gather_done->blockStream(ctx_.lanes.computeStream());
}

void Z3Executor::release(DsId id, int64_t n_users) {
  Z3Layout& z3 = param(id, "release_param").z3("dc.release_param");
  TORCH_CHECK(n_users >= 1, "dc.release_param: n_users must be >= 1, got ", n_users, " (ds id ", id, ")");
  ReleaseCount& count = releases_[id];
  if (count.remaining == 0) {
    count.remaining = n_users;
    count.n_users = n_users;
  } else {
    TORCH_CHECK(count.n_users == n_users, "dc.release_param: inconsistent n_users for ds id ", id, " in graph ",
                graph_id_, ": this gather episode started with ", count.n_users, ", got ", n_users);
  }
  if (--count.remaining > 0 || z3.persistent) return;
  // Several graphs may use a parameter at once (e.g. nested frames): the last holder frees it.
  if (ctx_.any_holds_gather(id)) return;
  // hpZ: the first release after the shards changed leaves this rank's node-local chunk behind,
  // so the next gathers (the backward's, the next micro-step's) stay inside the secondary group.
  if (ctx_.secondary_comm != nullptr) keepSecondary(ctx_.lanes, *ctx_.secondary_comm, z3);
  freeGathered(ctx_.lanes, z3);
}

bool Z3Executor::holdsGather(DsId id) const {
  auto it = releases_.find(id);
  return it != releases_.end() && it->second.remaining > 0;
}

void Z3Executor::endBackward(bool update_step) {
  if (!update_step) return;
  // The optimizer is about to change the shards: gathered copies (persistent ones included)
  // become stale. Persistent buffers are kept and re-filled by the next gather.
  for (DsId id : ids_) {
    Z3Layout& z3 = param(id, "end_backward").z3("dc.end_backward");
    if (z3.persistent) z3.valid = false;
  }
}

}  // namespace deepcompile
