"""`vllm-mixprec quantize` on broken inputs and a full disk.

Inputs: every case exits with status 2 and one line that names the file or tensor and the
fix, before any quantization work. Output: a failure while writing never leaves a folder at
the output path (or, with --overwrite, leaves the previous output untouched).
Cases covered in test_cli.py are not repeated (missing folder, no config.json, unsupported
architecture, bad group size, existing output, a failure on the first shard).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_mixprec import cli
from vllm_mixprec.quantize import export
from vllm_mixprec.quantize.testing import calib_text_file, save_tiny

DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_bad")
    return save_tiny(d / "llama", "llama"), calib_text_file(d / "calib.txt")


@pytest.fixture
def src(tiny):
    """A private, world-readable copy of the tiny model (tests break it on purpose)."""
    d = Path(tempfile.mkdtemp(prefix="mixprec-src-", dir="/tmp"))
    d.chmod(0o755)
    shutil.copytree(tiny[0], d / "m")
    yield d / "m"
    for p in (d / "m").iterdir():
        p.chmod(0o644)
    shutil.rmtree(d)


def small(text):
    return ["--calib-text", str(text), "--calib-samples", "2", "--calib-seqlen", "64", "--quiet"]


def run(args, capsys, rc):
    # transformers' log handler keeps the sys.stderr of its first use: after an earlier test's
    # in-process cli.main that is a closed capture, and a warning here would print a traceback
    from transformers.utils import logging as hf_logging
    hf_logging._reset_library_root_logger()
    hf_logging._configure_library_root_logger()
    got = cli.main(["quantize", *map(str, args)])
    err = capsys.readouterr().err
    assert got == rc, err
    ours = [ln for ln in err.splitlines() if ln.startswith("vllm-mixprec quantize: ")]
    assert len(ours) == 1 and "Traceback" not in err, err  # one line, no traceback
    return ours[0]


@contextlib.contextmanager
def as_unprivileged_user():
    """File permissions do not stop root: drop to `nobody` (effective ids) for the block."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def _rewrite_weights(folder: Path, edit) -> None:
    f = folder / "model.safetensors"
    t = load_file(f)
    edit(t)
    save_file(t, f, metadata={"format": "pt"})


# --- unreadable or corrupt input ----------------------------------------------------------

def test_corrupt_config_json(src, tmp_path, capsys):
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_si')
    err = run([src, tmp_path / "o"], capsys, 2)
    assert "config.json is not valid JSON" in err and "restore it from the original model" in err
    assert not (tmp_path / "o").exists()


def test_config_json_that_is_not_an_object(src, tmp_path, capsys):
    (src / "config.json").write_text("[1, 2]")
    err = run([src, tmp_path / "o"], capsys, 2)
    assert "config.json holds a JSON list, not an object" in err


@pytest.fixture
def writable_out(src):
    """An output path the unprivileged user may create."""
    d = src.parent / "out-parent"
    d.mkdir()
    d.chmod(0o777)
    return d / "o"


@pytest.mark.parametrize("victim", ["config.json", "model.safetensors"])
def test_unreadable_file(src, writable_out, capsys, victim):
    (src / victim).chmod(0)
    with as_unprivileged_user():
        err = run([src, writable_out], capsys, 2)
    assert f"{victim}: permission denied" in err and "chmod a+r" in err, err
    assert not writable_out.exists()


def test_unreadable_folder(src, writable_out, capsys):
    src.chmod(0o700)  # the folder itself: its entries cannot even be looked at
    try:
        with as_unprivileged_user():
            err = run([src, writable_out], capsys, 2)
    finally:
        src.chmod(0o755)
    assert "permission denied" in err and "chmod -R a+rX" in err, err
    assert "does not exist" not in err


def test_unwritable_output_is_refused_before_any_work(src, capsys):
    """Found at start, not after an hour of quantization when the first shard is written."""
    with as_unprivileged_user():
        err = run([src, src.parent / "o"], capsys, 2)  # src.parent is 0755 root: not writable
    assert "is not writable; choose an output folder you can write to" in err, err


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors(src, tmp_path, capsys, damage):
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x10\x00" + os.urandom(64),
                   "empty": b""}[damage])
    err = run([src, tmp_path / "o"], capsys, 2)
    assert "model.safetensors is not a readable safetensors file" in err, err
    assert "truncated or corrupt" in err and "download or convert the model again" in err


@pytest.mark.parametrize("victim", ["model.safetensors", "model.safetensors.index.json"])
def test_fifo_instead_of_a_file_does_not_hang(src, tmp_path, capsys, victim):
    """Opening a FIFO for reading blocks until a writer appears: a stray pipe (or a download
    tool's half-made special file) must give an error, not a quantizer that never returns."""
    import signal

    (src / victim).unlink(missing_ok=True)
    os.mkfifo(src / victim)
    signal.signal(signal.SIGALRM, lambda *a: pytest.fail("the CLI blocked on a FIFO"))
    signal.alarm(60)
    try:
        err = run([src, tmp_path / "o"], capsys, 2)
    finally:
        signal.alarm(0)
    assert f"{victim} is not a regular file" in err, err


def test_index_names_a_missing_shard(src, tmp_path, capsys):
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {DOWN: "model-00002-of-00002.safetensors",
                                            "model.norm.weight": "model-00001-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    err = run([src, tmp_path / "o"], capsys, 2)
    assert "['model-00002-of-00002.safetensors'] that are missing" in err, err


def test_missing_source_tensor(src, tiny, tmp_path, capsys):
    """transformers would initialise it randomly (a warning only): the quantizer refuses."""
    _rewrite_weights(src, lambda t: t.pop(DOWN))
    err = run([src, tmp_path / "o", *small(tiny[1])], capsys, 2)
    assert DOWN in err and "missing from the checkpoint" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_source_weight(src, tiny, tmp_path, capsys, value):
    def poison(t):
        t[DOWN][3, 5] = value
    _rewrite_weights(src, poison)
    err = run([src, tmp_path / "o", *small(tiny[1])], capsys, 2)
    nans = 1 if value != value else 0
    assert f"{DOWN}: 1 of {128 * 256} values are NaN or Inf ({nans} NaN)" in err, err
    assert "refuses non-finite weights" in err and "re-download" in err


# --- a full disk while writing --------------------------------------------------------------

def _tensors(n=6):
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(64, 64, generator=g) for i in range(n)}


def _disk_full_after(monkeypatch, ok_writes: int):
    """export.save_file writes `ok_writes` shards, then fails like a full disk, leaving a
    partial file behind as a real ENOSPC does."""
    real, calls = export.save_file, []

    def save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) > ok_writes:
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(export, "save_file", save)
    return calls


def test_disk_full_after_the_first_shard(tmp_path, monkeypatch):
    calls = _disk_full_after(monkeypatch, 1)
    with pytest.raises(OSError) as e:
        export.write_checkpoint(tmp_path / "out", _tensors(), {"architectures": ["X"]}, tmp_path,
                                None, shard_bytes=64 * 64 * 4 * 2)
    assert e.value.errno == errno.ENOSPC
    assert len(calls) == 2  # the first shard was complete on disk when the second failed
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no hidden temp folder


def test_disk_full_with_overwrite_keeps_the_previous_output(tmp_path, monkeypatch):
    out = export.write_checkpoint(tmp_path / "out", _tensors(2), {"architectures": ["X"]}, tmp_path,
                                  None)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _disk_full_after(monkeypatch, 1)
    with pytest.raises(OSError):
        export.write_checkpoint(out, _tensors(6), {"architectures": ["Y"]}, tmp_path, None,
                                overwrite=True, shard_bytes=64 * 64 * 4 * 2)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_disk_full_on_the_last_file_through_the_cli(tiny, tmp_path, monkeypatch, capsys):
    """All shards written, then config.json's fix-up fails: still no output folder."""
    def full(folder):
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(folder) / "config.json"))

    monkeypatch.setattr(export, "fix_config", full)
    err = run([tiny[0], tmp_path / "o", *small(tiny[1])], capsys, 1)
    assert "No space left on device" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_every_file_is_flushed_before_the_rename(tmp_path, monkeypatch):
    """A power loss after the rename must not find empty files under the final name."""
    real_fsync, real_rename = os.fsync, Path.rename
    synced, order = [], []

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def rename(self, target):
        order.append((len(synced), Path(target).name))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    out = export.write_checkpoint(tmp_path / "out", _tensors(), {"architectures": ["X"]}, tmp_path,
                                  None, shard_bytes=64 * 64 * 4 * 2)
    names = {Path(p).name for p in synced[:order[0][0]]}
    assert {p.name for p in out.iterdir()} <= names  # every file, before the rename
    assert len(list(out.glob("*.safetensors"))) == 3
    assert synced[-1] == str(tmp_path)  # and the parent folder after it


@pytest.mark.parametrize("value,why", [("a,b", "not a comma-separated list of integers"),
                                       ("0,-1", "layer indices are >= 0")])
def test_eval_kv_skip_layers_is_checked(value, why, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "some-folder", "--kv-skip-layers", value])
    assert e.value.code == 2
    assert why in capsys.readouterr().err
