// ZeRO-3 parameter gathering: filling, copying out and freeing a parameter's gathered buffer.
// Shared by the ZeRO-3 executor (allgather_param, prefetch, release) and the runtime
// (set_persistent, re-registration), which is why it is not part of either. They see only a
// parameter's ZeRO-3 layout: gathering has no meaning for a ZeRO-1/2 parameter.
#pragma once

#include <deepcompile/common.h>
#include <deepcompile/registry.h>

#include <vector>

namespace deepcompile {

class Communicator;
class Lanes;

// Starts gathering `params` (in `dtypes`) on the all-gather lane and marks them valid; used by
// allgather_param, prefetch and set_persistent. Parameters whose hpZ secondary copy is current
// are gathered from it over `secondary` (one group), the others from their shards over `comm`
// (another group); `secondary` null: no hpZ, every parameter goes over `comm`.
void launchGathers(Lanes& lanes, Communicator& comm, const std::vector<Z3Layout*>& params,
                   const std::vector<at::ScalarType>& dtypes, Communicator* secondary = nullptr);
// hpZ: allocates `param`'s secondary copy (padded_numel / secondary.size() elements in the gather
// dtype) when it has none, or drops it (`keep` false: a persistent parameter never needs it).
void provideSecondary(Lanes& lanes, Communicator& secondary, Z3Layout& param, bool keep);
// hpZ: before a use releases `param`'s gathered buffer, copies this rank's chunk of it (within
// the secondary group) into the secondary copy, which later gathers then read until the next
// invalidation. Only a buffer in the gather dtype holding the current value is kept.
void keepSecondary(Lanes& lanes, Communicator& secondary, Z3Layout& param);
// Gathers `param` into a fresh, unregistered flat padded buffer (the caller owns it) and orders
// the compute stream after the gather.
at::Tensor gatherPrivateCopy(Lanes& lanes, Communicator& comm, const Z3Layout& param, at::ScalarType dtype);
// Frees a parameter's gathered storage itself (every view of it then has 0 bytes).
void freeGathered(Lanes& lanes, Z3Layout& param);
// The same for a step being abandoned: a gather whose collective failed has finished (gloo will not
// write its buffer any more), so its failure is dropped here instead of rethrown, and the
// parameter is left ungathered as after any free.
void freeGatheredDroppingFailure(Lanes& lanes, Z3Layout& param);
// Before gathering `params`: raises (naming the ds id) for a shard whose device storage was freed
// and that has no host shard, and orders the all-gather lane after the offload lane's pending
// write-backs when a host shard is to be read. Called before any collective group opens.
void prepareGatherSources(Lanes& lanes, const std::vector<const Z3Layout*>& params);
// What a gather of `param` sends from, read on the all-gather lane (which must be the current
// stream): its host shard when one is set (parameter offload; on a GPU copied to a device staging
// buffer on the lane first, so the reload is the first link of the gather), else its device shard.
at::Tensor gatherSource(Lanes& lanes, const Z3Layout& param);
// Whether `shard` has storage behind all its elements (an offloaded shard has none).
bool shardHasStorage(const at::Tensor& shard);

}  // namespace deepcompile
