// Host-side launch helpers shared by the csrc launchers.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace mixprec {

// Sets a function attribute of kKernel once per device (not a stream operation, so it is safe
// while a CUDA graph is being captured); each kTag keeps its own record.
template <auto kKernel, int kTag>
cudaError_t set_attribute_once(cudaFuncAttribute attribute, int value) {
  static std::atomic<unsigned long long> configured{0};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const unsigned long long bit = 1ull << (dev & 63);
  if (configured.load(std::memory_order_relaxed) & bit) return cudaSuccess;
  e = cudaFuncSetAttribute(kKernel, attribute, value);
  if (e == cudaSuccess) configured.fetch_or(bit, std::memory_order_relaxed);
  return e;
}

// Launches kKernel with `smem` bytes of dynamic shared memory, as a programmatic dependent launch
// when pdl (sm_90; the caller checks), in thread block clusters of `cluster` CTAs when that is not
// 1 x 1 x 1 (sm_90). Over 48 KB of shared memory, and over 8 CTAs a cluster (Hopper's non-portable
// sizes, up to 16), the kernel is opted in once per device.
template <auto kKernel, typename... Args>
cudaError_t launch_kernel_clustered(dim3 grid, dim3 block, int smem, bool pdl, dim3 cluster, cudaStream_t stream,
                                    const Args&... args) {
  if (smem > 48 * 1024) {
    const cudaError_t e = set_attribute_once<kKernel, 0>(cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  if (cluster.x * cluster.y * cluster.z > 8) {
    const cudaError_t e = set_attribute_once<kKernel, 1>(cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) return e;
  }
  cudaLaunchAttribute attrs[2];
  unsigned n = 0;
  if (pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = cluster.x;
    attrs[n].val.clusterDim.y = cluster.y;
    attrs[n++].val.clusterDim.z = cluster.z;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kKernel, args...);
}
template <auto kKernel, typename... Args>
cudaError_t launch_kernel(dim3 grid, dim3 block, int smem, bool pdl, cudaStream_t stream, const Args&... args) {
  return launch_kernel_clustered<kKernel>(grid, block, smem, pdl, dim3(1, 1, 1), stream, args...);
}

}  // namespace mixprec
