"""Fixtures of the A/B harness tests: tiny random checkpoints of every kind, built once."""
import os
import sys

import pytest

# --import-mode=importlib puts no test directory on sys.path; ab_helpers and fake_vllm live here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ab_helpers import TINY  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory):
    from vllm_mixprec.eval import synthetic as syn

    work = tmp_path_factory.mktemp("ab-work")
    dirs = syn.ensure_checkpoints(work, TINY, syn.CKPT_KINDS, log=lambda *a: None)
    return work, dirs


@pytest.fixture
def cpu_platform(monkeypatch):
    """vLLM's own `vllm bench` swaps the Unspecified platform for CPU the same way."""
    from vllm import platforms
    from vllm.platforms.cpu import CpuPlatform
    monkeypatch.setattr(platforms, "current_platform", CpuPlatform())
