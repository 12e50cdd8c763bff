"""scripts/kernel_text_diff.py: a kernel's machine code compared across two builds (CPU, nvcc only)."""
import shutil

import pytest

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

KERNEL = """
namespace {{
__global__ void scale(float* y, const float* x, int n) {{
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * {factor};
}}
__global__ void copy(float* y, const float* x) {{ y[threadIdx.x] = x[threadIdx.x]; }}
}}
void launch(float* y, const float* x, int n) {{ scale<<<1, 32>>>(y, x, n); copy<<<1, 32>>>(y, x); }}
"""


def _cubin(tool, tmp_path, name, factor):
    src = tmp_path / name / "k.cu"  # another path: another anonymous-namespace hash in the names
    src.parent.mkdir()
    src.write_text(KERNEL.format(factor=factor))
    out = tmp_path / f"{name}.cubin"
    tool.compile_cubin(str(src), str(src.parent), "80", str(out))
    return tool.text_sections(str(out))


def test_same_code_same_digests_and_a_change_shows(repo_module, tmp_path):
    tool = repo_module("scripts/kernel_text_diff.py")
    a = _cubin(tool, tmp_path, "a", "2.0f")
    b = _cubin(tool, tmp_path, "b", "2.0f")
    c = _cubin(tool, tmp_path, "c", "3.0f")
    assert len(a) == 2 and all(n.startswith(".text.") and "_GLOBAL__N__" in n for n in a)
    assert a == b  # the path-dependent namespace hash is stripped
    changed = [n for n in a if a[n] != c[n]]
    assert len(changed) == 1 and "scale" in changed[0]
