import os
import sys

# --import-mode=importlib puts no test directory on sys.path; cuda_gemm_helpers lives here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
