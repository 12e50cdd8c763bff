// Host-side launch helper shared by the csrc GEMM launchers.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace mixprec {

// Launches kKernel with `smem` bytes of dynamic shared memory, as a programmatic dependent launch
// when pdl (sm_90; the caller checks). Over 48 KB the kernel is opted in once per device (not a
// stream operation, so it is safe while a CUDA graph is being captured).
template <auto kKernel, typename... Args>
cudaError_t launch_kernel(dim3 grid, dim3 block, int smem, bool pdl, cudaStream_t stream, const Args&... args) {
  if (smem > 48 * 1024) {
    static std::atomic<unsigned long long> configured{0};
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    const unsigned long long bit = 1ull << (dev & 63);
    if (!(configured.load(std::memory_order_relaxed) & bit)) {
      e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) return e;
      configured.fetch_or(bit, std::memory_order_relaxed);
    }
  }
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kKernel, args...);
}

}  // namespace mixprec
