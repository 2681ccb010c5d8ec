// Collectives the runtime needs, behind one interface with two implementations:
// raw NCCL on the lanes (GPU) and a c10d ProcessGroup (gloo on CPU).
#pragma once

#include <deepcompile/common.h>

#include <cstdio>
#include <cstdlib>
#include <string>
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

// The dtypes both communicators carry (NCCL natively; gloo natively or staged through fp32): the
// floating-point types a parameter is gathered or reduced in, and the integer ones of control
// exchanges. Not fp8, complex or bool.
inline bool isWireDtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kHalf:
    case at::kDouble:
    case at::kBFloat16:
    case at::kLong:
    case at::kInt:
    case at::kChar:
    case at::kByte:
      return true;
    default:
      return false;
  }
}

// DC_DEBUG_COLLECTIVES=1 (anything but empty or "0") makes every communicator print each
// collective it issues to stderr: the first tool for a cross-rank mismatch (diff the ranks' logs).
inline bool collectiveTraceEnabled() {
  const char* debug = std::getenv("DC_DEBUG_COLLECTIVES");
  return debug != nullptr && debug[0] != '\0' && debug[0] != '0';
}

// One trace line: "[deepcompile rank 0] #3 allgather numel=4096" (the same for every communicator,
// so logs of the gloo and NCCL paths compare line by line). `n` counts the communicator's
// collectives from 1.
inline std::string formatCollectiveTrace(int rank, int64_t n, const char* what, int64_t numel) {
  char line[160];
  std::snprintf(line, sizeof(line), "[deepcompile rank %d] #%lld %s numel=%lld\n", rank, static_cast<long long>(n),
                what, static_cast<long long>(numel));
  return line;
}

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
  // Closes a group that failed part-way (an exception between beginGroup and endGroup), so the
  // next beginGroup works. What was issued may still run (other ranks may have issued the same
  // collectives), but its results are not delivered: buffers it was to fill stay unfilled. Must
  // not throw or block (it runs during unwinding). The default closes the group with endGroup
  // and drops its completion; the real communicators override it.
  virtual void abortGroup() noexcept {
    try {
      endGroup();
    } catch (...) {
      // Closing is all that matters here; the error that opened the unwind is the one reported.
    }
  }
  // Waits for the collectives of aborted groups to finish (abort_step), ignoring their errors:
  // the step they belonged to is being abandoned for an error the caller already has.
  virtual void settleAborted() {}

  // Whether collectives can be issued in `dtype`. Registration and every gather check it before
  // a group opens: a dtype found unsupported inside a group fails the group half-way, after
  // other ranks may have issued their part. Test doubles carry everything.
  virtual bool carries(at::ScalarType) const { return true; }
  // An error the communicator hit asynchronously (NCCL: ncclCommGetAsyncError), empty when none.
  // Non-blocking; may be called while collectives are in flight.
  virtual std::string asyncError() { return {}; }
  // Makes the communicator's outstanding collectives return without completing them (NCCL:
  // ncclCommAbort), so that a shutdown whose peers are gone does not wait for ever. The
  // communicator is unusable afterwards. Must not throw.
  virtual void abort() noexcept {}

  // Blocking exchange of a few host integers: returns size() * values.size() entries, rank-major.
  // Every rank must pass the same number of values.
  virtual std::vector<int64_t> allGatherInts(const std::vector<int64_t>& values) = 0;

  // Counted by every collective above (the implementations call count()); the engine reads and
  // resets them once per optimizer step.
  const CommBytes& bytes() const { return bytes_; }
  void resetBytes() { bytes_ = CommBytes{}; }

 protected:
  static int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }
  // Every collective calls it once, as it is issued (collectiveTraceEnabled, formatCollectiveTrace).
  void trace(const char* what, int64_t numel) {
    if (trace_) std::fputs(formatCollectiveTrace(rank(), ++traced_, what, numel).c_str(), stderr);
  }
  CommBytes bytes_;
  bool trace_ = collectiveTraceEnabled();
  int64_t traced_ = 0;
};

// RAII for a communicator group: opens it on construction; end() closes it normally, and a
// destructor that runs before end() (an exception inside the group) aborts it instead. Without
// this, one exception inside a group left the communicator "in a group" for good, and every later
// collective failed with "communicator groups cannot nest".
class CommGroup {
 public:
  CommGroup(Communicator& comm, Lane lane) : comm_(comm) { comm_.beginGroup(lane); }
  ~CommGroup() {
    if (open_) comm_.abortGroup();
  }
  CommGroup(const CommGroup&) = delete;
  CommGroup& operator=(const CommGroup&) = delete;
  // Closes the group; the completion covers every collective issued in it.
  CompletionPtr end() {
    open_ = false;  // endGroup leaves the group closed even when it throws
    return comm_.endGroup();
  }

 private:
  Communicator& comm_;
  bool open_ = true;
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
