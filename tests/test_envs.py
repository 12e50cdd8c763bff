"""vllm_mixprec/envs.py: the one table of environment variables, and how they are read."""
from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from vllm_mixprec import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_mixprec"
NAME_PREFIXES = ("MIXPREC_", "VLLM_MIXPREC_")


def _is_knob_like(value: object) -> bool:
    return (isinstance(value, str) and value.startswith(NAME_PREFIXES) and value.isupper()
            and not value.endswith("_") and value.replace("_", "").isalnum())


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def _names_in(tree: ast.Module) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and _is_knob_like(n.value)}


def test_every_name_the_package_spells_is_declared():
    undeclared = {f"{p.relative_to(ROOT)}: {name}" for p, tree in _modules()
                  for name in _names_in(tree) if name not in envs.BY_NAME}
    assert not undeclared, f"declare these in vllm_mixprec/envs.py: {sorted(undeclared)}"


def test_every_declared_knob_has_a_reader():
    in_package = set().union(*(_names_in(t) for p, t in _modules() if p.name != "envs.py"))
    for knob in envs.KNOBS:
        if knob.reader:
            for path in knob.reader.split(", "):
                assert knob.name in (ROOT / path).read_text(), (knob.name, path)
        else:
            assert knob.name in in_package, f"{knob.name} is declared but nothing reads it"


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "MIXPREC_..." assignments."""
    return {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Constant) and _is_knob_like(n.value.value)
            for t in n.targets if isinstance(t, ast.Name)}


def test_only_envs_reads_the_environment_for_a_knob():
    """os.environ.get(KNOB) / environ[KNOB] / os.getenv(KNOB) anywhere but envs.py would bypass
    the declared default and the uniform parsing."""
    offenders = []
    for path, tree in _modules():
        if path.name == "envs.py":
            continue
        consts = _constants(tree)

        def knob(node) -> str | None:
            if isinstance(node, ast.Constant) and _is_knob_like(node.value):
                return node.value
            return consts.get(node.id) if isinstance(node, ast.Name) else None

        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("get", "getenv") and node.args and knob(node.args[0])):
                owner = ast.unparse(node.func.value)
                if "environ" in owner or owner == "os":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
            if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                    and "environ" in ast.unparse(node.value) and knob(node.slice)):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, "read these through vllm_mixprec.envs: " + "; ".join(offenders)


def test_docs_environment_md_is_the_table():
    doc = ROOT / "docs" / "ENVIRONMENT.md"
    assert doc.read_text() == envs.markdown(), \
        "docs/ENVIRONMENT.md is stale: python -m vllm_mixprec.envs --write docs/ENVIRONMENT.md"


def test_table_is_well_formed():
    assert len(envs.BY_NAME) == len(envs.KNOBS), "a name is declared twice"
    assert {k.group for k in envs.KNOBS} == set(envs.GROUPS)
    for k in envs.KNOBS:
        assert k.accepts and k.doc.endswith(".") and "|" not in k.doc + k.accepts + (k.unset or ""), k.name
        assert (k.default is None) == bool(k.unset), f"{k.name}: a default or an `unset` text, one of them"


def test_get_applies_the_default_and_treats_empty_as_unset():
    assert envs.get("MIXPREC_X_WGMMA_ORDER", {}) == "1"
    assert envs.get("MIXPREC_X_WGMMA_ORDER", {"MIXPREC_X_WGMMA_ORDER": "  "}) == "1"
    assert envs.get("MIXPREC_X_WGMMA_ORDER", {"MIXPREC_X_WGMMA_ORDER": " codes "}) == "codes"
    assert envs.get("MIXPREC_KERNEL", {}) is None
    assert envs.explicit("MIXPREC_TP_ACT_SCALE", {}) is None
    assert envs.explicit("MIXPREC_TP_ACT_SCALE", {"MIXPREC_TP_ACT_SCALE": "rank"}) == "rank"
    with pytest.raises(KeyError, match="MIXPREC_NOPE is not declared in vllm_mixprec/envs.py"):
        envs.get("MIXPREC_NOPE", {})


def test_parsers_name_the_variable():
    assert envs.flag("MIXPREC_ATTN_PDL", {}) is False
    assert envs.flag("MIXPREC_ATTN_PDL", {"MIXPREC_ATTN_PDL": "1"}) is True
    with pytest.raises(ValueError, match=r"MIXPREC_ATTN_FAST_UNPACK='false': expected 0 or 1"):
        envs.flag("MIXPREC_ATTN_FAST_UNPACK", {"MIXPREC_ATTN_FAST_UNPACK": "false"})
    assert envs.integer("MIXPREC_W4A8_KERNEL", -2, 8, {}) == -1
    assert envs.integer("MIXPREC_W4A8_KERNEL", -2, 8, {"MIXPREC_W4A8_KERNEL": "-2"}) == -2
    for bad in ("x", "9", "-3", "1.5", "٣"):
        with pytest.raises(ValueError, match=rf"MIXPREC_W4A8_KERNEL='{bad}': expected an integer from -2 to 8"):
            envs.integer("MIXPREC_W4A8_KERNEL", -2, 8, {"MIXPREC_W4A8_KERNEL": bad})
    with pytest.raises(ValueError, match=r"MIXPREC_KV_RESIDUAL_SLOTS='0': expected an integer >= 1"):
        envs.integer("MIXPREC_KV_RESIDUAL_SLOTS", 1, None, {"MIXPREC_KV_RESIDUAL_SLOTS": "0"})
    assert envs.integers("MIXPREC_ATTN_DECODE_CFG", 3, {}) is None
    assert envs.integers("MIXPREC_ATTN_DECODE_CFG", 3, {"MIXPREC_ATTN_DECODE_CFG": "64, 4,3"}) == (64, 4, 3)
    for bad in ("64,4", "64,4,x", "64,0,3"):
        with pytest.raises(ValueError, match=r"MIXPREC_ATTN_DECODE_CFG=.*: expected 3 comma-separated integers > 0"):
            envs.integers("MIXPREC_ATTN_DECODE_CFG", 3, {"MIXPREC_ATTN_DECODE_CFG": bad})


def test_values_a_bare_int_used_to_reject_without_a_name(monkeypatch):
    """These raised int()'s "invalid literal" (or were taken as on) before envs.py."""
    from vllm_mixprec.attention_backend import residual
    from vllm_mixprec.kernels.triton import attention as A
    import torch

    monkeypatch.setenv("MIXPREC_KV_RESIDUAL", "sixteen")
    with pytest.raises(ValueError, match="MIXPREC_KV_RESIDUAL='sixteen'"):
        residual.residual_tokens(None, 16)
    monkeypatch.setenv("MIXPREC_KV_RESIDUAL", "200")
    with pytest.raises(ValueError, match="MIXPREC_KV_RESIDUAL='200': expected an integer from 0 to 128"):
        residual.residual_tokens(None, 16)
    monkeypatch.setenv("MIXPREC_KV_RESIDUAL", "8")
    assert residual.residual_tokens(None, 16) == 8
    monkeypatch.setenv("MIXPREC_KV_RESIDUAL_KERNEL", "no")
    with pytest.raises(ValueError, match="MIXPREC_KV_RESIDUAL_KERNEL='no': expected 0 or 1"):
        residual.kernel_by_default(torch.device("cpu"))
    monkeypatch.setenv("MIXPREC_ATTN_FAST_UNPACK", "false")
    with pytest.raises(ValueError, match="MIXPREC_ATTN_FAST_UNPACK='false'"):
        A.fast_unpack(torch.device("cpu"))
    monkeypatch.setenv("MIXPREC_ATTN_KBIAS_CHUNK", "24")
    with pytest.raises(ValueError, match="MIXPREC_ATTN_KBIAS_CHUNK=24: expected a power of two"):
        A.kbias_chunk(64)
    monkeypatch.setenv("MIXPREC_ATTN_KBIAS_CHUNK", "32")
    assert A.kbias_chunk(64) == 32 and A.kbias_chunk(16) == 16
    monkeypatch.setenv("MIXPREC_ATTN_PREFILL_CFG", "32,64,4")
    with pytest.raises(ValueError, match="MIXPREC_ATTN_PREFILL_CFG='32,64,4': expected 4"):
        A.prefill_config(128, 1)


def test_unknown_names_get_a_suggestion_and_one_warning(caplog):
    env = {"MIXPREC_KERNAL": "triton", "MIXPREC_X_WGMMA_ORDER": "codes", "MIXPREC_ZZZ": "1",
           "VLLM_MIXPREC_CACHE": "/tmp", "PATH": "/bin"}
    assert envs.unknown(env) == [("MIXPREC_KERNAL", "MIXPREC_KERNEL"), ("MIXPREC_ZZZ", None)]
    envs._warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.mixprec"):
        lines = envs.warn_unknown(env)
        again = envs.warn_unknown(env)
    assert again == [] and len(lines) == 2
    assert "MIXPREC_KERNAL is set but no MIXPREC_* setting has that name (did you mean MIXPREC_KERNEL?)" in lines[0]
    assert "MIXPREC_ZZZ" in lines[1] and "did you mean" not in lines[1]
    assert sum("MIXPREC_KERNAL" in r.getMessage() for r in caplog.records) == 1


def test_register_warns_about_unknown_names(monkeypatch, caplog):
    import vllm_mixprec

    monkeypatch.setenv("MIXPREC_FUSE_ACT_QAUNT", "0")
    envs._warned.discard("MIXPREC_FUSE_ACT_QAUNT")
    with caplog.at_level(logging.WARNING, logger="vllm.mixprec"):
        vllm_mixprec.register()
    assert any("MIXPREC_FUSE_ACT_QAUNT" in r.getMessage() and "MIXPREC_FUSE_ACT_QUANT" in r.getMessage()
               for r in caplog.records)


def test_cli_prints_and_writes(tmp_path, capsys):
    assert envs.main([]) == 0
    assert capsys.readouterr().out == envs.markdown()
    assert envs.main(["--write", str(tmp_path / "E.md")]) == 0
    assert (tmp_path / "E.md").read_text() == envs.markdown()
    assert envs.main(["--bogus"]) == 2


def test_describe_and_the_env_command(monkeypatch, capsys):
    from vllm_mixprec import cli

    env = {"MIXPREC_X_WGMMA_ORDER": "codes", "MIXPREC_KV_RESIDUAL": "0", "MIXPREC_KERNAL": "triton",
           "MIXPREC_ATTN_PDL": ""}
    assert envs.describe(env) == [
        "MIXPREC_X_WGMMA_ORDER=codes  (default 1; Serving: torch.compile)",
        "MIXPREC_KV_RESIDUAL=0  (default unset: the checkpoint's kv_residual_tokens, else the block "
        "size; Serving: attention and the KV cache)",
        "MIXPREC_KERNAL=triton  (unknown: changes nothing; did you mean MIXPREC_KERNEL?)"]
    for k in list(__import__("os").environ):
        if k.startswith(envs.PREFIX):
            monkeypatch.delenv(k)
    assert cli.main(["env"]) == 0
    assert "no MIXPREC_* variable is set" in capsys.readouterr().out
    monkeypatch.setenv("MIXPREC_TP_REDUCE", "exact")
    assert cli.main(["env"]) == 0
    assert capsys.readouterr().out.startswith("MIXPREC_TP_REDUCE=exact  (default model;")
    assert cli.main(["env", "--all"]) == 0
    assert capsys.readouterr().out == envs.markdown()
