// Page-locked host memory of exactly the size asked for. torch's pinned allocator rounds every
// block up to a power of two (a 180 MB Adam moment of a 7B model takes 256 MiB), which for
// offloaded training state costs a third more host memory than the state itself; offload buffers
// live as long as the engine, so they gain nothing from that allocator's caching either.
#pragma once

#include <cstddef>
#include <string>

namespace deepcompile {

// nullptr with `error` set when the memory cannot be pinned (0 bytes: nullptr, no error).
void* allocPinnedHost(std::size_t nbytes, std::string* error);
void freePinnedHost(void* ptr);
// Whether `ptr` lies in page-locked host memory the CUDA driver knows (allocPinnedHost's buffers,
// torch's pinned allocator, cudaHostRegister'ed memory). Asks the driver itself: a buffer torch did
// not allocate is pinned all the same.
bool isPinnedHost(const void* ptr);

}  // namespace deepcompile
