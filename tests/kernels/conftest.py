import os
import sys

import pytest

# --import-mode=importlib puts no test directory on sys.path; cuda_gemm_helpers lives here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def launch_options():
    """The csrc launch options' setter (cuda.set_launch_options), every option restored after the test."""
    from vllm_mixprec.kernels import cuda
    saved = cuda.set_launch_options()
    yield cuda.set_launch_options
    cuda.set_launch_options(**saved)
