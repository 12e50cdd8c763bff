"""Compiling Triton kernels for a GPU architecture on a machine without one (scripts/triton_aot.py):
Triton ships ptxas, so frontend, layout and PTX errors that the interpreter never meets show up
before the GPU run. The compile runs in a subprocess, since the test session sets
TRITON_INTERPRET=1 and the interpreter does not compile."""
from __future__ import annotations

import os
import subprocess
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts")


def ptxas_available() -> bool:
    import triton
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__),
                                       "backends", "nvidia", "bin", "ptxas"))


def run_aot(script: str, arch: int) -> None:
    """Runs `script` (sys.argv[1]: arch; scripts/ on sys.path) and asserts it printed "compiled"."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[2])\n" + script,
                          str(arch), SCRIPTS], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-4000:]
