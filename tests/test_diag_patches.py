"""The kernel patches in scripts/diag/ (diagnostics and candidates, timed by `gpu_check.sh
wgmma_diag`) must apply to the kernels as they are, alone and in the pairs the stage combines, so
that they cannot rot unnoticed until a GPU call fails on them."""
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "scripts" / "diag").glob("*.patch"))
GIT = shutil.which("git")


# The repository paths the patches change (their "+++ b/..." lines).
PATCHED_FILES = {line.split()[1][2:] for p in PATCHES for line in p.read_text().splitlines() if line.startswith("+++ ")}


def git_apply(patch_name: str, cwd, *flags: str):
    return subprocess.run([GIT, "apply", *flags, str(ROOT / "scripts" / "diag" / f"{patch_name}.patch")], cwd=cwd,
                          capture_output=True, text=True)


def test_there_are_patches():
    assert {p.stem for p in PATCHES} >= {"wgmma_feed_only", "wgmma_compute_only", "wgmma_no_w_copy",
                                         "wgmma_no_w_lds", "wgmma_w_cpasync", "wgmma_w_tma_all", "wgmma_k7_deep",
                                         "wgmma_no_wait", "wgmma_no_fence", "wgmma_no_dequant",
                                         "decode_feed_only", "decode_no_mma",
                                         "decode_no_dequant", "decode_dp4a_per_chunk"}
    # (wgmma_x16 and wgmma_x_tma, the x-copy diagnostics that became x in the wgmma k order, were
    # retired in session 63; they apply to commit 1e5c5ed and lie in
    # benchmarks/results/2026-12-04-s63/retired-diag/.)
    # (The decode patches timed and not adopted, double buffers, split tail, warp interleave,
    # feed-only with full activation loads, and the dp4a diagnostics that became decode_dp4a,
    # were retired in session 55; they apply to commit 9283cac: csrc/gemm/NOTES.md "Session 55".)


@pytest.mark.skipif(GIT is None, reason="needs git")
@pytest.mark.parametrize("names", [(p.stem,) for p in PATCHES] + [("wgmma_no_w_copy", "wgmma_no_w_lds"),
                                                                    ("wgmma_w_cpasync", "wgmma_no_w_lds"),
                                                                    ("wgmma_w_tma_all", "wgmma_k7_deep"),
                                                                    ("wgmma_compute_only", "wgmma_no_dequant")],
                         ids=lambda names: "+".join(names))
def test_diag_patches_apply(names, tmp_path):
    for rel in PATCHED_FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    for name in names:  # applied in turn, as the stage does
        got = git_apply(name, tmp_path)
        assert got.returncode == 0, f"{name}.patch no longer applies: {got.stderr}"
    for name in reversed(names):
        got = git_apply(name, tmp_path, "-R")
        assert got.returncode == 0, got.stderr
    for rel in PATCHED_FILES:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), f"{rel} not restored"
