#!/usr/bin/env bash
# Does a C++ exception thrown inside a torch custom op reach Python on this host?
# Builds a two-line op that fails a TORCH_CHECK with each C++ compiler found (the host's
# default $CXX and the system g++), calls it in a child process, and then runs the csrc
# ops' own error cases (tests/kernels/cuda_error_cases.py). Prints the toolchain facts
# that decide it: compiler versions, the libstdc++/libgcc_s the process loads.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=$(mktemp -d /tmp/diag-throw.XXXX)
echo "CC=${CC:-} CXX=${CXX:-}"
for c in "${CXX:-}" /usr/bin/g++ g++ c++; do
  [ -n "$c" ] && command -v "$c" >/dev/null && echo "$c: $($c --version | head -1) ($(command -v $c))"
done
python3 -c "import torch; print('torch', torch.__version__, 'cxx11 abi', torch._C._GLIBCXX_USE_CXX11_ABI, 'compiled with', torch.__config__.show().split('GCC')[1].split()[0] if 'GCC' in torch.__config__.show() else '?')"
cat > "$WORK/boom.cpp" <<'CPP'
#include <ATen/core/Tensor.h>
#include <torch/library.h>
at::Tensor boom(const at::Tensor& x, int64_t n) {
  TORCH_CHECK(n % 16 == 0, "boom: n = ", n, " must be a multiple of 16");
  return x;
}
TORCH_LIBRARY(diag_boom, m) { m.def("boom(Tensor x, int n) -> Tensor"); }
TORCH_LIBRARY_IMPL(diag_boom, CPU, m) { m.impl("boom", &boom); }
TORCH_LIBRARY_IMPL(diag_boom, CUDA, m) { m.impl("boom", &boom); }
CPP
cat > "$WORK/call.py" <<'PY'
import faulthandler, sys, torch
faulthandler.enable()
torch.ops.load_library(sys.argv[1])
for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
    try:
        torch.ops.diag_boom.boom(torch.ones(3, device=dev), 5)
        print(f"  {dev}: no exception (wrong)")
    except RuntimeError as e:
        print(f"  {dev}: caught:", str(e).splitlines()[0])
PY
variant() {  # NAME CXX
  local name=$1 cxx=$2 d="$WORK/$1"
  mkdir -p "$d" && cp "$WORK/boom.cpp" "$d/"
  echo "== variant $name (CXX=$cxx)"
  (cd "$d" && CXX=$cxx python3 - <<'PY' > build.log 2>&1
import os
from torch.utils.cpp_extension import load
load(name="diag_boom_ext", sources=["boom.cpp"], build_directory=os.getcwd(), is_python_module=False,
     extra_cflags=["-O3", "-std=c++17"], verbose=True)
PY
  ) || { echo "  build failed"; tail -5 "$d/build.log"; return; }
  local so; so=$(ls "$d"/*.so | head -1)
  python3 "$WORK/call.py" "$so"; echo "  exit $?"
  ldd "$so" | grep -E "stdc|gcc_s" | sed 's/^/  /'
}
[ -n "${CXX:-}" ] && variant host-default "$CXX"
[ -x /usr/bin/g++ ] && variant system /usr/bin/g++
echo "== csrc ops error cases"
python3 tests/kernels/cuda_error_cases.py; echo "exit $?"
