// Does compute-sanitizer racecheck follow barrier.cluster across a cluster's shared memory?
//
// The wgmma kernels' cluster pair (csrc/gemm/sm90/w4a8_gemm_wgmma.cu, splits = -2) stores half of
// each CTA's sums into its peer's ring with st.shared::cluster, between two cluster barriers, and
// racecheck reports those stores against the peer's earlier cp.async writes of the same bytes
// (csrc/gemm/NOTES.md, sessions 47-48). This probe runs the same protocol, stripped to a few
// lines, in variants, so that each racecheck count says what the tool does and does not follow:
//
//   push_cp  the pair's protocol: ring filled by cp.async, read, CTA barrier, cluster barrier,
//            stores into the peer, cluster barrier, reads of what the peer stored
//   push_st  the same with the ring filled by st.shared instead of cp.async
//   push_cg  push_cp written with cooperative_groups (cluster.sync, map_shared_rank)
//   pull_cp  each CTA overwrites its own ring, cluster barrier, loads the peer's with
//            ld.shared::cluster, cluster barrier (so that no CTA exits while read)
//   racy     push_cp without the first cluster barrier: a real race (the control)
//   mbar     the kernel's pipeline: a producer warpgroup fills a 2-slot ring over 4 stages with
//            4-byte cp.async, each stage signalled by cp.async.mbarrier.arrive.noinc, the slots
//            freed by the consumers' arrivals; then cp.async.wait_all and push_cp's exchange
//   mbar_zero  mbar, with the producer writing zeros over each slot (st.shared) once the
//            consumers have freed it, after its cp.async.wait_all
//   push_cp_y  push_cp in clusters along y (launch attribute (1, 2, 1)) instead of x
//   dyn4     push_cp with the ring in dynamic shared memory, filled by 4-byte cp.async whose
//            source size is a register (the kernels' cp_async4)
//
// Build and run (sm_90): nvcc -O2 -lineinfo -gencode=arch=compute_90a,code=sm_90a
//   racecheck_cluster_probe.cu -o probe && compute-sanitizer --tool racecheck ./probe push_cp
// The program checks its own sums and exits 1 on a wrong one. `probe clusters` prints how many
// clusters of 2 fit at once (cudaOccupancyMaxActiveClusters) for each wgmma kernel's shared memory.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWords = 4 * kThreads;  // 4 KB of ring per CTA

enum Variant { kPushCp, kPushSt, kPushCg, kPullCp, kRacy, kMbar, kMbarZero, kPushCpY, kDyn4 };
constexpr int kSlotWords = kWords / 2;  // mbar: 2 ring slots of 2 KB
constexpr int kMbarStages = 4;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cluster_sync_ptx() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ void st_peer(uint32_t saddr, uint32_t rank, int v) {
  asm volatile("{\n.reg .b32 a;\nmapa.shared::cluster.u32 a, %0, %1;\nst.shared::cluster.u32 [a], %2;\n}\n" ::"r"(saddr),
               "r"(rank), "r"(v)
               : "memory");
}
__device__ __forceinline__ int ld_peer(uint32_t saddr, uint32_t rank) {
  int v;
  asm volatile("{\n.reg .b32 a;\nmapa.shared::cluster.u32 a, %1, %2;\nld.shared::cluster.u32 %0, [a];\n}\n"
               : "=r"(v)
               : "r"(saddr), "r"(rank)
               : "memory");
  return v;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok = 0;
  while (!ok)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok)
                 : "r"(bar), "r"(parity)
                 : "memory");
}

// mbar / mbar_zero: threads 0-127 produce, 128-255 consume. Stage i (word w of slot i % 2) holds
// src[i * kSlotWords + w]; consumer c sums words c, c + 128, ... of every stage into out_sum[c].
// Then the exchange: consumer c stores words 8c..8c+7 of the peer's ring; out as push_cp's.
__device__ void probe_mbar(const int* my_src, int* my_out, int* my_sum, uint32_t rank, bool zero) {
  __shared__ __align__(16) int ring[kWords];
  __shared__ __align__(8) uint64_t bars[4];  // full[2], empty[2]
  const int t = threadIdx.x;
  const uint32_t full0 = smem_addr(&bars[0]), empty0 = smem_addr(&bars[2]);
  if (t == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(full0 + 8 * s, 128);
      mbar_init(empty0 + 8 * s, 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (t < 128) {
    for (int i = 0; i < kMbarStages; ++i) {
      const int s = i & 1;
      if (i >= 2) mbar_wait(empty0 + 8 * s, ((i >> 1) - 1) & 1);
      for (int j = 0; j < kSlotWords / 128; ++j) {
        const int w = t + 128 * j;
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, 4;\n" ::"r"(smem_addr(&ring[s * kSlotWords + w])),
                     "l"(my_src + i * kSlotWords + w)
                     : "memory");
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full0 + 8 * s) : "memory");
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    if (zero) {  // each slot once its last stage is consumed
      for (int i = kMbarStages - 2; i < kMbarStages; ++i) {
        const int s = i & 1;
        mbar_wait(empty0 + 8 * s, (i >> 1) & 1);
        for (int j = 0; j < kSlotWords / 128; ++j) ring[s * kSlotWords + t + 128 * j] = 0;
      }
    }
    __syncthreads();
    cluster_sync_ptx();
    cluster_sync_ptx();
    return;
  }
  const int c = t - 128;
  int sum = 0;
  for (int i = 0; i < kMbarStages; ++i) {
    const int s = i & 1;
    mbar_wait(full0 + 8 * s, (i >> 1) & 1);
    for (int j = 0; j < kSlotWords / 128; ++j) sum += ring[s * kSlotWords + c + 128 * j];
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(empty0 + 8 * s) : "memory");
  }
  my_sum[c] = sum;
  __syncthreads();
  cluster_sync_ptx();
  for (int i = 0; i < 8; ++i) {
    const int w = 8 * c + i;
    st_peer(smem_addr(&ring[w]), rank ^ 1u, static_cast<int>(rank) * 100000 + w * 3 + 1);
  }
  cluster_sync_ptx();
  for (int i = 0; i < 8; ++i) my_out[8 * c + i] = ring[8 * c + i];
}

// out[cta][w] = (ring word read before the exchange) + (the peer's value for word w). CTA `cta`
// has cluster rank cta & 1.
__device__ void probe_ring(const int* src, int* out, int variant, int cta, int* ring, int cp_bytes) {
  const uint32_t rank = cta & 1, peer = rank ^ 1u;
  const int t = threadIdx.x;
  const int* my_src = src + cta * kWords;
  // Fill: thread t writes words 4t..4t+3.
  if (variant == kPushSt) {
    for (int i = 0; i < 4; ++i) ring[4 * t + i] = my_src[4 * t + i];
  } else if (variant == kDyn4) {  // the kernels' copy: 4 bytes, the source size a register
    for (int i = 0; i < 4; ++i)
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(&ring[4 * t + i])),
                   "l"(my_src + 4 * t + i), "r"(cp_bytes)
                   : "memory");
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(&ring[4 * t])), "l"(my_src + 4 * t)
                 : "memory");
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  }
  __syncthreads();
  // Read another thread's words (the consumers' reads of the ring).
  const int nb = (t + 37) % kThreads;
  int before[4];
  for (int i = 0; i < 4; ++i) before[i] = ring[4 * nb + i];
  // The value CTA `rank` sends for word w.
  auto sent = [&](uint32_t from, int w) { return static_cast<int>(from) * 100000 + w * 3 + 1; };

  if (variant == kPullCp) {
    __syncthreads();
    for (int i = 0; i < 4; ++i) ring[4 * t + i] = sent(rank, 4 * t + i);  // own ring, for the peer to load
    cluster_sync_ptx();
    int got[4];
    for (int i = 0; i < 4; ++i) got[i] = ld_peer(smem_addr(&ring[4 * nb + i]), peer);
    cluster_sync_ptx();  // the peer may not exit (its shared memory gone) while this CTA loads
    for (int i = 0; i < 4; ++i) out[cta * kWords + 4 * t + i] = before[i] + got[i];
    return;
  }
  if (variant == kPushCg) {
    cg::cluster_group cluster = cg::this_cluster();
    __syncthreads();
    cluster.sync();
    int* peer_ring = cluster.map_shared_rank(ring, peer);
    for (int i = 0; i < 4; ++i) peer_ring[4 * t + i] = sent(rank, 4 * t + i);
    cluster.sync();
  } else {
    __syncthreads();
    if (variant != kRacy) cluster_sync_ptx();
    for (int i = 0; i < 4; ++i) st_peer(smem_addr(&ring[4 * t + i]), peer, sent(rank, 4 * t + i));
    cluster_sync_ptx();
  }
  for (int i = 0; i < 4; ++i) out[cta * kWords + 4 * t + i] = before[i] + ring[4 * nb + i];
}

__global__ void __cluster_dims__(2, 1, 1) probe(const int* src, int* out, int* sums, int variant) {
  if (variant == kMbar || variant == kMbarZero) {
    probe_mbar(src + blockIdx.x * kMbarStages * kSlotWords, out + blockIdx.x * kWords, sums + blockIdx.x * 128,
               blockIdx.x & 1, variant == kMbarZero);
    return;
  }
  __shared__ __align__(16) int ring[kWords];
  probe_ring(src, out, variant, blockIdx.x, ring, 4);
}
// push_cp_y: the same with clusters along y (launch attribute (1, 2, 1)), as the wgmma kernels'
// pair launched them before session 48: CTA (x, y) is cta 2x + y, rank y.
__global__ void probe_y(const int* src, int* out) {
  __shared__ __align__(16) int ring[kWords];
  probe_ring(src, out, kPushCp, 2 * blockIdx.x + blockIdx.y, ring, 4);
}
// dyn4: the ring in dynamic shared memory behind static words (as the kernels' is), filled by
// 4-byte cp.async whose source size is a register.
__global__ void __cluster_dims__(2, 1, 1) probe_dyn(const int* src, int* out, int cp_bytes) {
  __shared__ __align__(8) uint64_t pad[5];
  extern __shared__ __align__(16) int dyn_ring[];
  if (threadIdx.x == 1u << 30) pad[0] = 0;
  probe_ring(src, out, kDyn4, blockIdx.x, dyn_ring, cp_bytes);
}

// `probe clusters`: how many clusters of 2 CTAs of 384 threads fit at once for the shared memory
// of each wgmma kernel (133-203 KB: one CTA an SM), against the SM count. Not a race check: it
// tells whether a wave of paired CTAs can fill every SM.
__global__ void occupancy_dummy() {
  extern __shared__ int dyn[];
  if (threadIdx.x == 1u << 30) dyn[0] = 0;
}

int print_cluster_occupancy() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaFuncSetAttribute(occupancy_dummy, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  for (int kb : {133, 150, 165, 197, 203}) {
    cudaFuncSetAttribute(occupancy_dummy, cudaFuncAttributeMaxDynamicSharedMemorySize, kb * 1024);
    for (int size : {1, 2}) {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = size;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.gridDim = dim3(2 * sms);
      cfg.blockDim = dim3(384);
      cfg.dynamicSmemBytes = kb * 1024;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      int n = 0;
      const cudaError_t e = cudaOccupancyMaxActiveClusters(&n, occupancy_dummy, &cfg);
      std::printf("smem %d KB, cluster %d: %d clusters at once (%d CTAs of %d SMs)%s%s\n", kb, size, n, n * size, sms,
                  e == cudaSuccess ? "" : " error: ", e == cudaSuccess ? "" : cudaGetErrorString(e));
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "clusters") == 0) return print_cluster_occupancy();
  static const char* names[] = {"push_cp", "push_st", "push_cg", "pull_cp", "racy", "mbar", "mbar_zero", "push_cp_y", "dyn4"};
  int variant = -1;
  for (int v = 0; v < 9 && argc > 1; ++v)
    if (std::strcmp(argv[1], names[v]) == 0) variant = v;
  if (variant < 0) {
    std::fprintf(stderr, "usage: %s push_cp|push_st|push_cg|pull_cp|racy|mbar|mbar_zero|push_cp_y|dyn4|clusters\n", argv[0]);
    return 2;
  }
  const char* name = names[variant];
  constexpr int kCtas = 8;  // 4 clusters
  const bool mbar = variant == kMbar || variant == kMbarZero;
  std::vector<int> h_src(kCtas * kMbarStages * kSlotWords), h_out(kCtas * kWords, -1), h_sums(kCtas * 128, -1);
  for (size_t i = 0; i < h_src.size(); ++i) h_src[i] = static_cast<int>((i * 2654435761u) % 9973);
  int *d_src = nullptr, *d_out = nullptr, *d_sums = nullptr;
  cudaMalloc(&d_src, h_src.size() * sizeof(int));
  cudaMalloc(&d_out, h_out.size() * sizeof(int));
  cudaMalloc(&d_sums, h_sums.size() * sizeof(int));
  cudaMemcpy(d_src, h_src.data(), h_src.size() * sizeof(int), cudaMemcpyHostToDevice);
  cudaMemset(d_out, 0xFF, h_out.size() * sizeof(int));  // poison
  cudaMemset(d_sums, 0xFF, h_sums.size() * sizeof(int));
  if (variant == kDyn4) {
    probe_dyn<<<kCtas, kThreads, kWords * sizeof(int)>>>(d_src, d_out, 4);
    variant = kPushCp;  // checked as push_cp
  } else if (variant == kPushCpY) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = 2;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(kCtas / 2, 2);
    cfg.blockDim = dim3(kThreads);
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cudaLaunchKernelEx(&cfg, probe_y, static_cast<const int*>(d_src), d_out);
    variant = kPushCp;  // checked as push_cp
  } else {
    probe<<<kCtas, kThreads>>>(d_src, d_out, d_sums, variant);
  }
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", name, cudaGetErrorString(e));
    return 1;
  }
  cudaMemcpy(h_out.data(), d_out, h_out.size() * sizeof(int), cudaMemcpyDeviceToHost);
  cudaMemcpy(h_sums.data(), d_sums, h_sums.size() * sizeof(int), cudaMemcpyDeviceToHost);
  long bad = 0;
  if (mbar) {
    for (int c = 0; c < kCtas; ++c) {
      for (int w = 0; w < kWords; ++w)
        if (h_out[c * kWords + w] != (c ^ 1) % 2 * 100000 + w * 3 + 1) ++bad;
      for (int k = 0; k < 128; ++k) {
        int want = 0;
        for (int i = 0; i < kMbarStages; ++i)
          for (int j = 0; j < kSlotWords / 128; ++j) want += h_src[(c * kMbarStages + i) * kSlotWords + k + 128 * j];
        if (h_sums[c * 128 + k] != want) ++bad;
      }
    }
    std::printf("%s: %ld wrong of %d\n", name, bad, kCtas * (kWords + 128));
    return bad ? 1 : 0;
  }
  for (int c = 0; c < kCtas; ++c)
    for (int t = 0; t < kThreads; ++t) {
      const int nb = (t + 37) % kThreads;
      for (int i = 0; i < 4; ++i) {
        const int w = 4 * nb + i;
        const int want = h_src[c * kWords + w] + (c ^ 1) % 2 * 100000 + w * 3 + 1;
        if (h_out[c * kWords + 4 * t + i] != want) ++bad;
      }
    }
  std::printf("%s: %ld wrong of %d\n", name, bad, kCtas * kWords);
  return bad ? 1 : 0;
}
