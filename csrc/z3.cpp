// ZeRO-3: gathering parameters before use and freeing them after their last use.
#include <deepcompile/executor.h>
#include <deepcompile/runtime.h>

namespace deepcompile {

namespace {

bool hasStorageBytes(const at::Tensor& t) { return t.defined() && t.storage().nbytes() > 0; }

// Writes what this rank contributes to a gather of `p` (in `buffer`'s dtype) straight into its own
// chunk of `buffer` and returns that chunk: the gather then runs in place, with no staging temporary per
// parameter (one allocation and one launch less, per parameter and gather). The parameter's value
// is its shard rounded to the gather dtype (a trainable shard is the fp32 master copy, the module
// may be bf16), so the shard is cast to the gather dtype first and only then to another requested
// one: every dtype sees the same rounding as the module parameter. In the usual case (the buffer
// is in the gather dtype) the copy is the single cast.
at::Tensor stageOwnChunk(const DSParam& p, const at::Tensor& buffer, int rank) {
  at::Tensor shard = p.data.reshape({-1});
  if (shard.scalar_type() != p.gather_dtype && buffer.scalar_type() != p.gather_dtype) {
    shard = shard.to(p.gather_dtype);
  }
  at::Tensor own = buffer.narrow(0, static_cast<int64_t>(rank) * shard.numel(), shard.numel());
  own.copy_(shard);
  return own;
}

}  // namespace

void launchGathers(Runtime& rt, const std::vector<DSParam*>& params, const std::vector<at::ScalarType>& dtypes) {
  TORCH_INTERNAL_ASSERT(params.size() == dtypes.size());
  if (params.empty()) return;
  Lanes& lanes = rt.lanes();
  Communicator& comm = rt.comm();
  // The gather reads the shard (final once the optimizer step queued on compute is done) and may
  // overwrite a reused buffer that compute kernels still read: wait for compute first.
  lanes.waitCompute(Lane::AllGather);
  {
    LaneScope scope(lanes, Lane::AllGather);
    comm.beginGroup(Lane::AllGather);
    for (size_t i = 0; i < params.size(); ++i) {
      DSParam& p = *params[i];
      const at::ScalarType dtype = dtypes[i];
      // Reuse the previous buffer only when it has the right size *and* dtype (a persistent
      // parameter re-gathered in another dtype must not get the old dtype back).
      const bool reuse = hasStorageBytes(p.gathered) && p.gathered.numel() == p.paddedNumel() &&
                         p.gathered.scalar_type() == dtype;
      if (!reuse) {
        if (p.gathered.defined()) lanes.recordStream(p.gathered, lanes.computeStream());
        // Allocated on the all-gather lane: the allocator then orders its reuse after the gather.
        p.gathered = at::empty({p.paddedNumel()}, p.data.options().dtype(dtype));
      }
      comm.allGather(stageOwnChunk(p, p.gathered, comm.rank()), p.gathered);  // fused down-cast
      p.valid = true;
    }
  }
  CompletionPtr done = comm.endGroup();
  for (DSParam* p : params) p->gather_done = done;
}

at::Tensor gatherPrivateCopy(Runtime& rt, DSParam& p, at::ScalarType dtype) {
  Lanes& lanes = rt.lanes();
  lanes.waitCompute(Lane::AllGather);
  at::Tensor buffer;
  {
    LaneScope scope(lanes, Lane::AllGather);
    buffer = at::empty({p.paddedNumel()}, p.data.options().dtype(dtype));
    rt.comm().beginGroup(Lane::AllGather);
    rt.comm().allGather(stageOwnChunk(p, buffer, rt.comm().rank()), buffer);
  }
  rt.comm().endGroup()->blockStream(lanes.computeStream());
  lanes.recordStream(buffer, lanes.computeStream());
  return buffer.narrow(0, 0, p.numel).view(p.shape);
}

void freeGathered(Runtime& rt, DSParam& p) {
  if (p.gathered.defined()) {
    // CPU: the gather may still write into the buffer from gloo's thread; finish it first.
    // CUDA: the compute stream read the buffer after waiting for the gather; the allocator must
    // not hand the block out before those kernels ran.
    if (p.gather_done && rt.device().is_cpu()) p.gather_done->hostWait();
    rt.lanes().recordStream(p.gathered, rt.lanes().computeStream());
    // Free the storage itself, not just this handle: views handed to the graph share it and
    // would otherwise keep the padded buffer alive.
    p.gathered.storage().unsafeGetStorageImpl()->reset();
  }
  p.gathered = at::Tensor();
  p.valid = false;
  p.gather_done = nullptr;
}

at::Tensor Z3Executor::allgather(DsId id, std::optional<at::ScalarType> dtype) {
  DSParam& p = param(id, "allgather_param");
  const at::ScalarType target = dtype.value_or(p.gather_dtype);
  if (!(p.valid && p.gathered.defined())) {
    launchGathers(rt_, {&p}, {target});
    return p.gatheredView();
  }
  // Prefetches and persistent gathers land in the gather dtype, which is also what a request
  // without a dtype asks for: the normal path returns the buffer without any conversion.
  if (p.gathered.scalar_type() == target) return p.gatheredView();
  if (p.gathered.scalar_type() == p.gather_dtype) {
    // Valid in the gather dtype, another one requested (e.g. a fused cast of a persistent
    // parameter): the buffer holds the parameter's exact values, so converting gives what a
    // fresh gather would, but only after the gather landed.
    if (p.gather_done) p.gather_done->blockStream(rt_.lanes().computeStream());
    return p.gatheredView().to(target);
  }
  // Valid only in a narrower dtype: converting back would lose precision. Gather a private
  // copy in the requested dtype; the registered buffer is left to its own release.
  return gatherPrivateCopy(rt_, p, target);
}

void Z3Executor::prefetch(const std::vector<DsId>& ids, const std::vector<at::ScalarType>& dtypes) {
  std::vector<DSParam*> todo;
  std::vector<at::ScalarType> todo_dtypes;
  for (size_t i = 0; i < ids.size(); ++i) {
    DSParam& p = param(ids[i], "prefetch_params_fused");
    if (p.valid && p.gathered.defined()) continue;
    todo.push_back(&p);
    todo_dtypes.push_back(dtypes[i]);
  }
  launchGathers(rt_, todo, todo_dtypes);
}

void Z3Executor::wait(DsId id) {
  DSParam& p = param(id, "wait_allgather");
  TORCH_CHECK(p.valid && p.gathered.defined(), "dc.wait_allgather: ds id ", id,
              " is not gathered (no allgather_param or prefetch issued since its last release)");
  if (p.gather_done) p.gather_done->blockStream(rt_.lanes().computeStream());
}

void Z3Executor::release(DsId id, int64_t n_users) {
  DSParam& p = param(id, "release_param");
  TORCH_CHECK(n_users >= 1, "dc.release_param: n_users must be >= 1, got ", n_users, " (ds id ", id, ")");
  ReleaseCount& count = releases_[id];
  if (count.remaining == 0) {
    count.remaining = n_users;
    count.n_users = n_users;
  } else {
    TORCH_CHECK(count.n_users == n_users, "dc.release_param: inconsistent n_users for ds id ", id, " in graph ",
                graph_id_, ": this gather episode started with ", count.n_users, ", got ", n_users);
  }
  if (--count.remaining > 0 || p.persistent) return;
  // Several graphs may use a parameter at once (e.g. nested frames): the last holder frees it.
  if (rt_.anyExecutorHoldsGather(id)) return;
  freeGathered(rt_, p);
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
    DSParam& p = rt_.registry().get(id);
    if (p.persistent) {
      p.valid = false;
    }
  }
}

}  // namespace deepcompile
