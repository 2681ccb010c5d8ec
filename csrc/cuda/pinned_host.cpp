// Exact-size page-locked host buffers (see deepcompile/pinned_host.h). Only the CUDA runtime API
// is included: this unit stays cheap to compile.
#include <deepcompile/pinned_host.h>

#include <cuda_runtime_api.h>

namespace deepcompile {

void* allocPinnedHost(std::size_t nbytes, std::string* error) {
  if (nbytes == 0) return nullptr;
  void* ptr = nullptr;
  // Portable: the buffer counts as pinned for every device context of the process.
  const cudaError_t status = cudaHostAlloc(&ptr, nbytes, cudaHostAllocPortable);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // reset the last error, so that later CUDA calls do not report this one
    if (error != nullptr) *error = cudaGetErrorString(status);
    return nullptr;
  }
  return ptr;
}

void freePinnedHost(void* ptr) {
  if (ptr != nullptr) (void)cudaFreeHost(ptr);
}

bool isPinnedHost(const void* ptr) {
  if (ptr == nullptr) return false;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    (void)cudaGetLastError();  // not a pointer the driver knows: pageable
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

}  // namespace deepcompile
