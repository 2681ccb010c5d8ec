// ZeRO-3 parameter gathering: filling, copying out and freeing a parameter's gathered buffer.
// Shared by the ZeRO-3 executor (allgather_param, prefetch, release) and the runtime
// (set_persistent, re-registration), which is why it is not part of either.
#pragma once

#include <deepcompile/common.h>
#include <deepcompile/registry.h>

#include <vector>

namespace deepcompile {

class Communicator;
class Lanes;

// Starts gathering `params` (in `dtypes`) as one group on the all-gather lane and marks them
// valid; used by allgather_param, prefetch and set_persistent.
void launchGathers(Lanes& lanes, Communicator& comm, const std::vector<DSParam*>& params,
                   const std::vector<at::ScalarType>& dtypes);
// Gathers `param` into a fresh, unregistered buffer (the caller owns it) and orders the compute
// stream after the gather.
at::Tensor gatherPrivateCopy(Lanes& lanes, Communicator& comm, DSParam& param, at::ScalarType dtype);
// Frees a parameter's gathered storage itself (every view of it then has 0 bytes).
void freeGathered(Lanes& lanes, DSParam& param);

}  // namespace deepcompile
