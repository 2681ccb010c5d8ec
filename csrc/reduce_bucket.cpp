#include <deepcompile/reduce_bucket.h>

namespace deepcompile {

ReduceBucket::ReduceBucket(int64_t capacity, at::ScalarType dtype, BufferAllocator allocate)
    : capacity_(capacity), dtype_(dtype), allocate_(std::move(allocate)) {
  TORCH_CHECK(capacity > 0, "reduce bucket capacity must be positive, got ", capacity);
}

void ReduceBucket::reserve(int64_t numel) {
  if (numel <= capacity_) return;
  TORCH_CHECK(offset_ == 0, "deepcompile: cannot grow a reduce bucket that holds pending slots");
  buffer_ = at::Tensor();  // drop first so old and new buffer are never both alive
  capacity_ = numel;
}

at::Tensor ReduceBucket::allocate(int64_t numel) {
  TORCH_CHECK(numel >= 0 && offset_ + numel <= capacity_, "deepcompile: reduce bucket slot of ", numel,
              " elements does not fit (offset ", offset_, ", capacity ", capacity_, ")");
  if (!buffer_.defined()) buffer_ = allocate_(capacity_, dtype_);
  at::Tensor slot = buffer_.narrow(0, offset_, numel);
  offset_ += numel;
  return slot;
}

at::Tensor ReduceBucket::used() const {
  if (!buffer_.defined()) return at::Tensor();
  return buffer_.narrow(0, 0, offset_);
}

DoubleBufferedReduceBucket::DoubleBufferedReduceBucket(int64_t initial_capacity, bool double_buffer,
                                                       BufferAllocator allocate)
    : initial_capacity_(initial_capacity), double_buffer_(double_buffer), allocate_(std::move(allocate)) {
  TORCH_CHECK(initial_capacity > 0, "reduce bucket size must be positive, got ", initial_capacity);
}

ReduceBucket& DoubleBufferedReduceBucket::current(at::ScalarType dtype) {
  auto it = pairs_.find(dtype);
  if (it == pairs_.end()) {
    Pair pair;
    pair.current = std::make_unique<ReduceBucket>(initial_capacity_, dtype, allocate_);
    if (double_buffer_) pair.shadow = std::make_unique<ReduceBucket>(initial_capacity_, dtype, allocate_);
    it = pairs_.emplace(dtype, std::move(pair)).first;
  }
  return *it->second.current;
}

void DoubleBufferedReduceBucket::swap(at::ScalarType dtype, CompletionPtr done) {
  auto it = pairs_.find(dtype);
  TORCH_CHECK(it != pairs_.end(), "deepcompile: no reduce bucket for dtype ", dtype);
  Pair& pair = it->second;
  pair.current->reset();
  pair.current->last_use = std::move(done);
  if (double_buffer_) std::swap(pair.current, pair.shadow);
}

int64_t DoubleBufferedReduceBucket::allocatedNumel() const {
  int64_t total = 0;
  for (const auto& kv : pairs_) {
    for (const auto* bucket : {kv.second.current.get(), kv.second.shadow.get()}) {
      if (bucket != nullptr && bucket->allocated()) total += bucket->capacity();
    }
  }
  return total;
}

}  // namespace deepcompile
