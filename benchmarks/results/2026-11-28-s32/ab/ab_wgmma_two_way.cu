// A/B of the wgmma W4A8 kernel: this tree's build against session 31's (HEAD~) on one GPU, one
// process, interleaved rounds. Random bytes (timing only). Prints median us per call.
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "gemm/w4a8_gemm.h"
namespace mixprec {
const char* w4a8_wgmma_make_plan(int, int, int, int, int, int, int, bool, W4A8Plan*);
cudaError_t w4a8_wgmma_launch(const W4A8GemmArgs&, const W4A8Plan&, cudaStream_t);
}
namespace mixprec_s31 {  // session 31's declarations (same layouts, other namespace)
enum class W4A8Kernel : int { kAuto = -1 };
struct W4A8GemmArgs { mixprec::W4A8GemmArgs a; };
struct W4A8Plan { W4A8Kernel kernel; int splits; int num_counters; };
const char* w4a8_wgmma_make_plan(int, int, int, int, int, int, int, W4A8Plan*);
cudaError_t w4a8_wgmma_launch(const W4A8GemmArgs&, const W4A8Plan&, cudaStream_t);
}
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)
static void* rnd(size_t bytes) { std::vector<unsigned char> h(bytes); for (auto& b : h) b = rand() & 0xff; void* d; CK(cudaMalloc(&d, bytes)); CK(cudaMemcpy(d, h.data(), bytes, cudaMemcpyHostToDevice)); return d; }
int main() {
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp pr; CK(cudaGetDeviceProperties(&pr, 0)); printf("%s, %d SMs\n", pr.name, sms);
  const int shapes[][4] = {{1024, 4096, 6144, 4}, {1024, 4096, 4096, 4}, {1024, 8192, 10240, 4}, {256, 4096, 6144, 5},
                           {256, 14336, 4096, 5}, {1024, 8192, 28672, 4}};
  for (auto& sh : shapes) {
    const int M = sh[0], K = sh[1], N = sh[2], kern = sh[3], G = 128;
    const int copies = std::max(1, (int)(200e6 / ((size_t)N * K / 2)));
    std::vector<void*> qw, gp, cs;
    for (int c = 0; c < copies; ++c) { qw.push_back(rnd((size_t)N * K / 2)); gp.push_back(rnd((size_t)N / 16 * (K / G) * 32)); cs.push_back(rnd((size_t)N * 4)); }
    void* xq = rnd((size_t)M * K); float* xs; CK(cudaMalloc(&xs, M * 4)); CK(cudaMemset(xs, 0, M * 4));
    void* out; CK(cudaMalloc(&out, (size_t)M * N * 2));
    for (int c = 0; c < copies; ++c) CK(cudaMemset(cs[c], 0, N * 4));  // finite outputs
    mixprec::W4A8GemmArgs a{};
    a.xq = (const int8_t*)xq; a.x_scale = xs; a.bias = nullptr; a.bias_kind = mixprec::BiasKind::kNone;
    a.out = out; a.out_kind = mixprec::OutKind::kHalf; a.M = M; a.N = N; a.K = K; a.group_size = G; a.pdl = false;
    mixprec::W4A8Plan pn{}; const char* e1 = mixprec::w4a8_wgmma_make_plan(M, N, K, G, sms, kern, 1, false, &pn);
    mixprec_s31::W4A8Plan po{}; const char* e2 = mixprec_s31::w4a8_wgmma_make_plan(M, N, K, G, sms, kern, 1, &po);
    if (e1 || e2) { printf("plan error %s %s\n", e1 ? e1 : "", e2 ? e2 : ""); return 1; }
    cudaEvent_t t0, t1; CK(cudaEventCreate(&t0)); CK(cudaEventCreate(&t1));
    std::vector<float> tn, to;
    int it = 0;
    auto run = [&](bool isnew, int reps) {
      for (int r = 0; r < reps; ++r, ++it) {
        const int c = it % copies;
        a.qweight = (const uint8_t*)qw[c]; a.gparams = (const uint32_t*)gp[c]; a.channel_scale = (const float*)cs[c];
        CK(isnew ? mixprec::w4a8_wgmma_launch(a, pn, 0) : mixprec_s31::w4a8_wgmma_launch(reinterpret_cast<const mixprec_s31::W4A8GemmArgs&>(a), po, 0));
      }
    };
    run(true, 20); run(false, 20); CK(cudaDeviceSynchronize());
    for (int round = 0; round < 15; ++round)
      for (int v = 0; v < 2; ++v) {
        const bool isnew = (round + v) & 1;
        CK(cudaEventRecord(t0)); run(isnew, 50); CK(cudaEventRecord(t1)); CK(cudaEventSynchronize(t1));
        float ms; CK(cudaEventElapsedTime(&ms, t0, t1)); (isnew ? tn : to).push_back(ms * 1000 / 50);
      }
    std::sort(tn.begin(), tn.end()); std::sort(to.begin(), to.end());
    printf("M=%5d K=%5d N=%5d kernel %d splits 1: s31 %.1f us, s32 %.1f us (median of 15 x 50 calls), s32/s31 %.3f\n",
           M, K, N, kern, to[to.size() / 2], tn[tn.size() / 2], tn[tn.size() / 2] / to[to.size() / 2]);
    for (auto p : qw) cudaFree(p); for (auto p : gp) cudaFree(p); for (auto p : cs) cudaFree(p);
    cudaFree(xq); cudaFree(xs); cudaFree(out);
  }
  return 0;
}
