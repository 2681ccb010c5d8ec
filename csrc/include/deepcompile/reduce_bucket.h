// Reduce buckets: flat buffers that batch many gradients into few collectives.
#pragma once

#include <deepcompile/common.h>

#include <functional>
#include <map>

namespace deepcompile {

// Allocates a flat buffer of (numel, dtype) on the runtime's device and lane.
using BufferAllocator = std::function<at::Tensor(int64_t numel, at::ScalarType dtype)>;

// One flat buffer of a single dtype, handed out slot by slot.
class ReduceBucket {
 public:
  ReduceBucket(int64_t capacity, at::ScalarType dtype, BufferAllocator allocate);

  int64_t capacity() const { return capacity_; }
  int64_t offset() const { return offset_; }
  at::ScalarType dtype() const { return dtype_; }
  // A non-empty bucket that cannot take `numel` more elements must be flushed first.
  bool shouldFlush(int64_t numel) const { return offset_ > 0 && offset_ + numel > capacity_; }
  // Grows the buffer so one slot of `numel` fits (contents are dropped). The old buffer is only
  // released: its allocator stream (or, on CPU, the collective holding it) keeps it from reuse
  // while a collective still reads it.
  void reserve(int64_t numel);
  // The next `numel` elements, as a view.
  at::Tensor allocate(int64_t numel);
  // The slots handed out since the last reset.
  at::Tensor used() const;
  void reset() { offset_ = 0; }
  bool allocated() const { return buffer_.defined(); }

  // Completion of the last collective that read this buffer: writers into a reused buffer wait
  // on it (write-after-read across lanes).
  CompletionPtr last_use;

 private:
  int64_t capacity_;
  int64_t offset_ = 0;
  at::ScalarType dtype_;
  BufferAllocator allocate_;
  at::Tensor buffer_;
};

// Per dtype, a current bucket that is filled and (when double-buffered) a shadow bucket whose
// collective may still be in flight; swap() exchanges them so filling overlaps reducing.
class DoubleBufferedReduceBucket {
 public:
  DoubleBufferedReduceBucket(int64_t initial_capacity, bool double_buffer, BufferAllocator allocate);

  ReduceBucket& current(at::ScalarType dtype);
  bool has(at::ScalarType dtype) const { return pairs_.count(dtype) != 0; }
  // The current bucket of `dtype` was flushed; `done` completes when its collective has read it.
  void swap(at::ScalarType dtype, CompletionPtr done);
  // Drops every buffer (callers make sure nothing is in flight).
  void clear() { pairs_.clear(); }
  // Elements held by all buffers of all dtypes.
  int64_t allocatedNumel() const;
  bool doubleBuffered() const { return double_buffer_; }

 private:
  struct Pair {
    std::unique_ptr<ReduceBucket> current;
    std::unique_ptr<ReduceBucket> shadow;
  };
  int64_t initial_capacity_;
  bool double_buffer_;
  BufferAllocator allocate_;
  std::map<at::ScalarType, Pair> pairs_;
};

}  // namespace deepcompile
