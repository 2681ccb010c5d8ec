// Gathering a ZeRO-3 parameter into its padded buffer, and freeing that buffer.
#include <deepcompile/communicator.h>
#include <deepcompile/fault_injection.h>
#include <deepcompile/gather.h>
#include <deepcompile/lanes.h>

namespace deepcompile {

namespace {

bool hasStorageBytes(const at::Tensor& t) { return t.defined() && t.storage().nbytes() > 0; }

// Writes what this rank contributes to a gather (in `buffer`'s dtype) straight into its own
// chunk of `buffer` and returns that chunk: the gather then runs in place, with no staging temporary per
// parameter (one allocation and one launch less, per parameter and gather). `source` is the shard
// the gather sends (gatherSource). The parameter's value is its shard rounded to the gather dtype
// (a trainable shard is the fp32 master copy, the module may be bf16), so the shard is cast to the
// gather dtype first and only then to another requested one: every dtype sees the same rounding
// as the module parameter. In the usual case (the buffer is in the gather dtype) the copy is the
// single cast.
at::Tensor stageOwnChunk(const at::Tensor& source, at::ScalarType gather_dtype, const at::Tensor& buffer, int rank) {
  at::Tensor shard = source.reshape({-1});
  if (shard.scalar_type() != gather_dtype && buffer.scalar_type() != gather_dtype) {
    shard = shard.to(gather_dtype);
  }
  at::Tensor own = buffer.narrow(0, static_cast<int64_t>(rank) * shard.numel(), shard.numel());
  own.copy_(shard);
  return own;
}

}  // namespace

namespace {

// Gives `p` a buffer for a gather in `dtype`: its previous one when the size *and* dtype fit (a
// persistent parameter re-gathered in another dtype must not get the old dtype back), else a
// fresh one. Called on the all-gather lane, before the group opens: an allocation failure then
// leaves no communicator group half-issued.
void prepareGatherBuffer(Lanes& lanes, Z3Layout& p, at::ScalarType dtype) {
  const bool reuse =
      hasStorageBytes(p.gathered) && p.gathered.numel() == p.padded_numel && p.gathered.scalar_type() == dtype;
  if (reuse) return;
  if (p.gathered.defined()) lanes.recordStream(p.gathered, lanes.computeStream());
  faultPoint(FaultKind::GatherAlloc, "the gathered-buffer allocation");
  // Allocated on the all-gather lane: the allocator then orders its reuse after the gather.
  p.gathered = at::empty({p.padded_numel}, p.shard.options().dtype(dtype));
}

// Undoes a gather group that failed part-way: none of its parameters holds gathered values (the
// collectives never completed, or completed into a group whose results were dropped), so none may
// be waited on as valid. Non-persistent buffers are dropped (a later gather allocates afresh);
// persistent ones are kept, invalid, for the next gather to refill. Only the handle is dropped,
// never the storage: collectives already issued may still write into it (gloo's threads hold
// their own references; on a GPU the block was allocated on the all-gather lane, so the allocator
// reuses it only after that lane's queued collectives).
class GatherRollback {
 public:
  explicit GatherRollback(const std::vector<Z3Layout*>& params) : params_(params) {}
  ~GatherRollback() {
    if (committed_) return;
    for (Z3Layout* p : params_) {
      p->valid = false;
      p->gather_done = nullptr;
      if (!p->persistent) p->gathered = at::Tensor();
    }
  }
  GatherRollback(const GatherRollback&) = delete;
  GatherRollback& operator=(const GatherRollback&) = delete;
  void commit() { committed_ = true; }

 private:
  const std::vector<Z3Layout*>& params_;
  bool committed_ = false;
};

// One group of gathers over `comm`: each parameter's buffer (reused when its size and dtype fit)
// receives every rank's chunk; the own chunk is staged from its shard (or its hpZ secondary copy
// when `comm` is the secondary communicator). Everything that allocates (buffers, host-shard
// staging) happens before the group opens; a parameter becomes valid only once its group closed.
void issueGatherGroup(Lanes& lanes, Communicator& comm, const std::vector<Z3Layout*>& params,
                      const std::vector<at::ScalarType>& dtypes, bool from_secondary) {
  if (params.empty()) return;
  for (at::ScalarType dtype : dtypes) {
    // Refused before the group opens: inside it, the failure would come after other ranks issued.
    TORCH_CHECK(comm.carries(dtype), "deepcompile: cannot gather in ", dtype, ": the ", comm.name(),
                " communicator does not carry it (float32, float16, bfloat16 or float64)");
  }
  GatherRollback rollback(params);
  std::vector<at::Tensor> sources;
  sources.reserve(params.size());
  {
    LaneScope scope(lanes, Lane::AllGather);
    for (size_t i = 0; i < params.size(); ++i) {
      prepareGatherBuffer(lanes, *params[i], dtypes[i]);
      // An offloaded shard is brought in here, as the first link of the gather. A secondary copy
      // is already in the gather dtype.
      sources.push_back(from_secondary ? params[i]->secondary : gatherSource(lanes, *params[i]));
    }
  }
  CommGroup group(comm, Lane::AllGather);
  {
    LaneScope scope(lanes, Lane::AllGather);
    for (size_t i = 0; i < params.size(); ++i) {
      Z3Layout& p = *params[i];
      // The source (the shard, a host shard's staging copy or the secondary copy) is read on this
      // lane: the allocator must not hand its block out again before that read ran, whatever the
      // caller does with it meanwhile (offload frees a shard's device storage).
      lanes.recordStream(sources[i], lanes.stream(Lane::AllGather));
      // Fused down-cast into this rank's own chunk; the gather then runs in place.
      comm.allGather(stageOwnChunk(sources[i], p.gather_dtype, p.gathered, comm.rank()), p.gathered);
    }
  }
  CompletionPtr done = group.end();
  for (Z3Layout* p : params) {
    p->valid = true;
    p->gather_done = done;
  }
  rollback.commit();
}

}  // namespace

void launchGathers(Lanes& lanes, Communicator& comm, const std::vector<Z3Layout*>& params,
                   const std::vector<at::ScalarType>& dtypes, Communicator* secondary) {
  TORCH_INTERNAL_ASSERT(params.size() == dtypes.size());
  if (params.empty()) return;
  std::vector<Z3Layout*> primary, local;
  std::vector<at::ScalarType> primary_dtypes, local_dtypes;
  for (size_t i = 0; i < params.size(); ++i) {
    const bool from_secondary = secondary != nullptr && params[i]->secondary_valid;
    (from_secondary ? local : primary).push_back(params[i]);
    (from_secondary ? local_dtypes : primary_dtypes).push_back(dtypes[i]);
  }
  prepareGatherSources(lanes, std::vector<const Z3Layout*>(primary.begin(), primary.end()));
  // The gather reads the shard (final once the optimizer step queued on compute is done) and may
  // overwrite a reused buffer that compute kernels still read: wait for compute first.
  lanes.waitCompute(Lane::AllGather);
  // Every rank of a secondary group holds the same secondary state (the same releases and
  // invalidations ran everywhere), so the two groups are issued alike on every rank.
  issueGatherGroup(lanes, comm, primary, primary_dtypes, false);
  if (secondary != nullptr) issueGatherGroup(lanes, *secondary, local, local_dtypes, true);
}

void provideSecondary(Lanes& lanes, Communicator& secondary, Z3Layout& p, bool keep) {
  if (!keep) {
    // A gather queued on the all-gather lane may still read it.
    if (p.secondary.defined()) lanes.recordStream(p.secondary, lanes.stream(Lane::AllGather));
    p.secondary = at::Tensor();
    p.secondary_valid = false;
    return;
  }
  if (p.secondary.defined()) return;
  TORCH_INTERNAL_ASSERT(p.padded_numel % secondary.size() == 0, "deepcompile: ds id ", p.ds_id, ": padded size ",
                        p.padded_numel, " is not a multiple of the hpZ group size ", secondary.size());
  p.secondary = at::empty({p.padded_numel / secondary.size()}, p.shard.options().dtype(p.gather_dtype));
  p.secondary_valid = false;
}

void keepSecondary(Lanes& lanes, Communicator& secondary, Z3Layout& p) {
  if (p.secondary_valid || !p.secondary.defined() || !p.isGathered() ||
      p.gathered.scalar_type() != p.gather_dtype) {
    return;
  }
  // The buffer is read on the compute stream, which waited for the gather before the use that
  // now releases it (a CPU gather may still run on gloo's thread: finish it first).
  if (p.gather_done) {
    if (lanes.device().is_cpu()) {
      p.gather_done->hostWait();
    } else {
      p.gather_done->blockStream(lanes.computeStream());
    }
  }
  const int64_t chunk = p.secondary.numel();
  p.secondary.copy_(p.gathered.narrow(0, static_cast<int64_t>(secondary.rank()) * chunk, chunk));
  p.secondary_valid = true;
}

at::Tensor gatherPrivateCopy(Lanes& lanes, Communicator& comm, const Z3Layout& p, at::ScalarType dtype) {
  prepareGatherSources(lanes, {&p});
  lanes.waitCompute(Lane::AllGather);
  at::Tensor buffer;
  at::Tensor source;
  {
    LaneScope scope(lanes, Lane::AllGather);
    faultPoint(FaultKind::GatherAlloc, "a private gathered copy's allocation");
    buffer = at::empty({p.padded_numel}, p.shard.options().dtype(dtype));
    source = gatherSource(lanes, p);
  }
  // A private buffer: nothing of the registry to roll back if the group fails.
  CommGroup group(comm, Lane::AllGather);
  {
    LaneScope scope(lanes, Lane::AllGather);
    lanes.recordStream(source, lanes.stream(Lane::AllGather));  // read on this lane (issueGatherGroup)
    comm.allGather(stageOwnChunk(source, p.gather_dtype, buffer, comm.rank()), buffer);
  }
  group.end()->blockStream(lanes.computeStream());
  lanes.recordStream(buffer, lanes.computeStream());
  return buffer;
}

bool shardHasStorage(const at::Tensor& shard) {
  if (!shard.defined()) return false;
  const int64_t needed = (shard.storage_offset() + shard.numel()) * static_cast<int64_t>(shard.element_size());
  return shard.numel() == 0 || static_cast<int64_t>(shard.storage().nbytes()) >= needed;
}

void prepareGatherSources(Lanes& lanes, const std::vector<const Z3Layout*>& params) {
  bool any_host = false;
  for (const Z3Layout* p : params) {
    any_host = any_host || p->host_shard.defined();
    TORCH_CHECK(p->host_shard.defined() || shardHasStorage(p->shard), "deepcompile: ds id ", p->ds_id,
                ": its device shard has no storage (it was offloaded) and no host shard is set, so there is "
                "nothing to gather from (set_host_shard must name the host copy before the device storage is freed)");
  }
  // Host shards are written back by copies on the offload lane: the gathers read them only after
  // everything queued there so far. (A CPU runtime's offload copies are synchronous.)
  if (any_host && !lanes.device().is_cpu()) {
    lanes.record(Lane::Offload)->blockStream(lanes.stream(Lane::AllGather));
  }
}

at::Tensor gatherSource(Lanes& lanes, const Z3Layout& p) {
  if (!p.host_shard.defined()) return p.shard;
  // A CPU runtime's "device" is the host: the host shard is read as it is.
  if (lanes.device().is_cpu()) return p.host_shard;
  // Allocated on the all-gather lane (the current stream) and used only there: once the own chunk
  // is staged, the allocator may hand the block out again to work ordered after it on this lane.
  at::Tensor staging = at::empty(p.shard.sizes(), p.shard.options());
  staging.copy_(p.host_shard, /*non_blocking=*/true);
  return staging;
}

namespace {

void freeGatheredImpl(Lanes& lanes, Z3Layout& p, bool drop_failure) {
  if (p.gathered.defined()) {
    // CPU: the gather may still write into the buffer from gloo's thread; finish it first.
    // CUDA: the compute stream read the buffer after waiting for the gather; the allocator must
    // not hand the block out before those kernels ran.
    if (p.gather_done && lanes.device().is_cpu()) {
      try {
        p.gather_done->hostWait();
      } catch (const std::exception&) {
        if (!drop_failure) throw;  // a failed wait has finished the collective: the buffer can go
      }
    }
    lanes.recordStream(p.gathered, lanes.computeStream());
    // Free the storage itself, not just this handle: views handed to the graph share it and
    // would otherwise keep the padded buffer alive.
    p.gathered.storage().unsafeGetStorageImpl()->reset();
  }
  p.gathered = at::Tensor();
  p.valid = false;
  p.gather_done = nullptr;
}

}  // namespace

void freeGathered(Lanes& lanes, Z3Layout& p) { freeGatheredImpl(lanes, p, false); }

void freeGatheredDroppingFailure(Lanes& lanes, Z3Layout& p) { freeGatheredImpl(lanes, p, true); }

}  // namespace deepcompile
