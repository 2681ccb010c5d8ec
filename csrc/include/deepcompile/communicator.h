// Collectives the runtime needs, behind one interface with two implementations:
// raw NCCL on the lanes (GPU) and a c10d ProcessGroup (gloo on CPU).
#pragma once

#include <deepcompile/common.h>

#include <vector>

namespace c10d {
class ProcessGroup;
}

namespace deepcompile {

class Lanes;

// Payload bytes of the collectives one communicator issued: the size of the whole buffer each
// collective works on, in the dtype it was issued in (an all-gather's output, a reduce-scatter's
// input, a reduce's or all-reduce's buffer), on this rank. What crosses the links follows from
// it and the communicator's size (docs/design/hybrid_sharding.md); control exchanges
// (allGatherInts) are not counted.
struct CommBytes {
  int64_t all_gather = 0;
  int64_t reduce_scatter = 0;
  int64_t reduce = 0;
  int64_t all_reduce = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* name() const = 0;

  // Collectives are issued between beginGroup(lane) and endGroup(); endGroup returns one
  // completion for all of them. All ranks must issue the same sequence.
  virtual void beginGroup(Lane lane) = 0;
  // recv (flat, size() * send.numel() elements) = concatenation of every rank's send. `send` may
  // be this rank's own chunk of `recv` (an in-place gather).
  virtual void allGather(const at::Tensor& send, const at::Tensor& recv) = 0;
  // Reductions average over ranks (what data-parallel gradients need). NCCL averages inside the
  // collective; a backend without an average divides its inputs first, which also keeps
  // low-precision sums in range. `send` / `buffer` may be overwritten (they are scratch).
  // recv (recv.numel() elements) = average over ranks of chunk rank() of send (size() chunks).
  virtual void reduceScatter(const at::Tensor& send, const at::Tensor& recv) = 0;
  // buffer on rank `root` = average over ranks of buffer (in place; other ranks' buffers are scratch).
  virtual void reduce(const at::Tensor& buffer, int root) = 0;
  // buffer on every rank = average over ranks of buffer (in place).
  virtual void allReduce(const at::Tensor& buffer) = 0;
  virtual CompletionPtr endGroup() = 0;

  // Blocking exchange of a few host integers: returns size() * values.size() entries, rank-major.
  // Every rank must pass the same number of values.
  virtual std::vector<int64_t> allGatherInts(const std::vector<int64_t>& values) = 0;

  // Counted by every collective above (the implementations call count()); the engine reads and
  // resets them once per optimizer step.
  const CommBytes& bytes() const { return bytes_; }
  void resetBytes() { bytes_ = CommBytes{}; }

 protected:
  static int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }
  CommBytes bytes_;
};

std::unique_ptr<Communicator> makeProcessGroupCommunicator(
    c10::intrusive_ptr<c10d::ProcessGroup> group);

#ifdef DC_WITH_NCCL
// Builds a private NCCL communicator over the ranks of `group`; the unique id is broadcast from
// the group's rank 0 through the group itself.
std::unique_ptr<Communicator> makeNcclCommunicator(
    c10::intrusive_ptr<c10d::ProcessGroup> group, c10::Device device, Lanes& lanes);
#endif

}  // namespace deepcompile
