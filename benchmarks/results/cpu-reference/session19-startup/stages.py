import sys, time, json
sys.argv, names = ["x"], sys.argv[1:]
sys.path.insert(0, "/tmp/startup")
import compile_times as C
from triton.backends.nvidia.compiler import CUDABackend
orig = CUDABackend.add_stages
T = {}
def add_stages(self, stages, options, language):
    orig(self, stages, options, language)
    for k, f in list(stages.items()):
        def w(src, md, f=f, k=k):
            t = time.perf_counter(); r = f(src, md); T[k] = T.get(k, 0) + time.perf_counter() - t; return r
        stages[k] = w
CUDABackend.add_stages = add_stages
C.V["Q"]()
for n in names:
    T.clear(); t = time.perf_counter(); C.V[n](); tot = time.perf_counter() - t
    print(n, round(tot, 2), {k: round(v, 2) for k, v in T.items()}, flush=True)
