"""Random-weight checkpoints of real shape, for speed runs on a host that has no network.

Shared by scripts/e2e_serve.py (a small model, quantized by RTN) and the A/B harness
(`vllm-mixprec ab`, Llama-3-8B shape). Four checkpoint kinds, all Hugging Face folders that
vLLM 0.26 loads as they are:

  bf16          every weight bf16, uniform with the std of HF's init (0.02)
  gptq          linears as GPTQ W4A16 (sym, group 128, checkpoint_format "gptq", desc_act false),
                random 4-bit codes; quantization/gptq.py's layout (pack_gptq) and config
  mixprec       linears as mixprec W4A8 (LiquidQuant, docs/FORMAT.md), random valid tensors drawn
                directly: q in [0, 15], step s in [1, 16], offset a = 128 + min in [9, 255 - 15 s]
  mixprec-kv4   the same tensors (hard links) with `kv_scheme: kv4` in the config

Tensors are generated one at a time and streamed into safetensors shards, so neither a whole
model nor a second copy of it is ever held in memory; on a GPU host they are drawn on the GPU
(seconds) and copied out. A folder is written under a temporary name and renamed at the end, so
an interrupted build never leaves a complete-looking checkpoint.

  python -m vllm_mixprec.eval.synthetic --work /tmp/mixprec-ab --layers 32 --ckpts bf16,gptq,mixprec,mixprec-kv4
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from .. import formats as F

WEIGHT_STD = 0.02  # HF's initializer_range for Llama
SHARD_BYTES = 4 * 1024**3
GPTQ_GROUP = 128
MIXPREC_GROUP = 64
MARKER = "synthetic.json"  # what a folder was built from; a mismatch means rebuild
CKPT_KINDS = ("bf16", "gptq", "mixprec", "mixprec-kv4")

_ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8",
             torch.int8: "I8", torch.int32: "I32", torch.int64: "I64"}


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """A Llama decoder's dimensions; the defaults are Llama-3-8B's."""

    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    inter: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0
    max_pos: int = 40960  # >= the 16K long-context run (as shared/baselines/kv_baseline.py)
    name: str = "llama3-8b"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tag(self) -> str:
        return f"{self.name}-L{self.layers}"

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """HF linear name -> (out N, in K) for one decoder layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"self_attn.q_proj": (q, self.hidden), "self_attn.k_proj": (kv, self.hidden),
                "self_attn.v_proj": (kv, self.hidden), "self_attn.o_proj": (self.hidden, q),
                "mlp.gate_proj": (self.inter, self.hidden), "mlp.up_proj": (self.inter, self.hidden),
                "mlp.down_proj": (self.hidden, self.inter)}


LLAMA3_8B = LlamaShape()


def llama_config(shape: LlamaShape):
    """transformers' LlamaConfig for `shape` (bos 0, eos 1: the trained tokenizer's ids)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.inter,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_pos,
                       rope_theta=shape.rope_theta, bos_token_id=0, eos_token_id=1,
                       tie_word_embeddings=False, torch_dtype="bfloat16")


def train_tokenizer(path: str | os.PathLike, vocab: int = 8192) -> None:
    """A byte-level BPE trained on this Python's standard library (no network needed).

    The trainer stops when it runs out of merges (about 39K tokens on 200 stdlib files), so a
    larger `vocab` gives a tokenizer smaller than the model's vocabulary; vLLM accepts that, and
    ids beyond it detokenize to nothing.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:200]
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>", "<unk>"],
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(path))


# --- streaming safetensors ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: Callable[[torch.device], torch.Tensor]  # -> exactly (shape, dtype), on that device

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def _plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    shards, cur, size = [], [], 0
    for s in specs:
        if cur and size + s.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += s.nbytes
    if cur or not shards:
        shards.append(cur)
    return shards


def write_safetensors(path: str | os.PathLike, specs: list[TensorSpec], device: torch.device) -> None:
    """One safetensors file, each tensor generated, written and freed in turn."""
    header, off = {}, 0
    for s in specs:
        header[s.name] = {"dtype": _ST_DTYPE[s.dtype], "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for s in specs:
            t = s.fill(device)
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                raise RuntimeError(f"{s.name}: generated {tuple(t.shape)} {t.dtype}, planned {s.shape} {s.dtype}")
            f.write(t.contiguous().cpu().view(torch.uint8).numpy().data)
            del t


def write_shards(folder: Path, specs: list[TensorSpec], device: torch.device,
                 shard_bytes: int = SHARD_BYTES) -> None:
    shards = _plan_shards(specs, shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / fn, shard, device)
        weight_map.update({s.name: fn for s in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# --- random tensors ------------------------------------------------------------------------

def _gen(name: str, seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed((zlib.crc32(name.encode()) + 7919 * seed) % 2**63)


def _uniform(shape, dtype, std, name, seed):
    a = std * 3 ** 0.5  # uniform(-a, a) has this std; cheaper to draw than a normal
    return lambda dev: torch.empty(shape, dtype=dtype, device=dev).uniform_(-a, a, generator=_gen(name, seed, dev))


def _ones(shape):
    return lambda dev: torch.ones(shape, dtype=torch.bfloat16, device=dev)


def _random_bytes(shape, name, seed, dev):
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=_gen(name, seed, dev))


def mixprec_step_offset(step: torch.Tensor) -> torch.Tensor:
    """A valid LiquidQuant offset for each step: the group centred on 0 (min = -ceil(15 s / 2)),
    kept in [9, 255 - 15 s] so that q * s + a never leaves a byte lane (formats.lqq_dequant_lanes)."""
    s = step.to(torch.int32)
    a = 128 - (F.W4_MAX * s + 1) // 2
    return torch.minimum(torch.clamp(a, min=9), 255 - F.W4_MAX * s).to(torch.uint8)


def mixprec_specs(prefix: str, n: int, k: int, group: int, seed: int) -> list[TensorSpec]:
    """Random W4 LiquidQuant tensors of one linear (formats.W4Layout), weight std about 0.02."""
    layout = F.W4Layout(n, k, group)
    specs = layout.tensor_specs()

    def step(dev):
        return torch.randint(1, F.MAX_GROUP_STEP + 1, specs["group_scale"][0], dtype=torch.uint8, device=dev,
                             generator=_gen(prefix + ".group_scale", seed, dev))

    # w8 = q*s + min with q uniform in [0, 15]: rms over s uniform in [1, 16] is about 46
    cs = WEIGHT_STD / 46.0
    fills = {
        "qweight": lambda dev: _random_bytes(specs["qweight"][0], prefix + ".qweight", seed, dev),
        "group_scale": step,
        "group_offset": lambda dev: mixprec_step_offset(step(dev)),
        "channel_scale": lambda dev: torch.empty(n, dtype=torch.float32, device=dev).uniform_(
            0.9 * cs, 1.1 * cs, generator=_gen(prefix + ".channel_scale", seed, dev)),
    }
    return [TensorSpec(f"{prefix}.{t}", shape, dtype, fills[t]) for t, (shape, dtype) in specs.items()]


def gptq_specs(prefix: str, n: int, k: int, group: int, seed: int) -> list[TensorSpec]:
    """Random GPTQ W4A16 tensors of one linear, in quantize/gptq.py's pack_gptq layout."""
    from ..quantize import gptq

    pack = gptq.GPTQ_PACK
    F.check_divisible("in_features", k, pack)
    F.check_divisible("out_features", n, pack)
    F.check_divisible("in_features", k, group)
    zero_word = sum((gptq.GPTQ_ZERO - 1) << (gptq.GPTQ_BITS * j) for j in range(pack))  # 0x77777777
    sc = WEIGHT_STD / 4.6  # (q - 8) uniform over [-8, 7] has rms 4.6
    return [
        # 8 random nibbles per int32 word: random bytes viewed as int32 (K/8 rows, packed along K)
        TensorSpec(f"{prefix}.qweight", (k // pack, n), torch.int32,
                   lambda dev: _random_bytes((k // pack, 4 * n), prefix + ".qweight", seed, dev).view(torch.int32)),
        TensorSpec(f"{prefix}.qzeros", (k // group, n // pack), torch.int32,
                   lambda dev: torch.full((k // group, n // pack), zero_word, dtype=torch.int32, device=dev)),
        TensorSpec(f"{prefix}.scales", (k // group, n), torch.float16,
                   lambda dev: torch.empty((k // group, n), dtype=torch.float16, device=dev).uniform_(
                       0.9 * sc, 1.1 * sc, generator=_gen(prefix + ".scales", seed, dev))),
        TensorSpec(f"{prefix}.g_idx", (k,), torch.int32,
                   lambda dev: torch.arange(k, dtype=torch.int32, device=dev) // group),
    ]


def checkpoint_specs(shape: LlamaShape, kind: str, seed: int = 0, group_size: int | None = None
                     ) -> list[TensorSpec]:
    """Every tensor of a Llama checkpoint of `kind` (bf16, gptq or mixprec), in file order."""
    if kind not in ("bf16", "gptq", "mixprec"):
        raise ValueError(f"unknown checkpoint kind {kind!r}")
    h, bf = shape.hidden, torch.bfloat16
    specs = [TensorSpec("model.embed_tokens.weight", (shape.vocab, h), bf,
                        _uniform((shape.vocab, h), bf, WEIGHT_STD, "model.embed_tokens.weight", seed))]
    for i in range(shape.layers):
        pre = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs.append(TensorSpec(f"{pre}.{norm}.weight", (h,), bf, _ones((h,))))
        for lin, (n, k) in shape.linear_shapes().items():
            p = f"{pre}.{lin}"
            if kind == "bf16":
                specs.append(TensorSpec(f"{p}.weight", (n, k), bf, _uniform((n, k), bf, WEIGHT_STD, p, seed)))
            elif kind == "gptq":
                specs += gptq_specs(p, n, k, group_size or GPTQ_GROUP, seed)
            else:
                specs += mixprec_specs(p, n, k, group_size or MIXPREC_GROUP, seed)
    specs.append(TensorSpec("model.norm.weight", (h,), bf, _ones((h,))))
    specs.append(TensorSpec("lm_head.weight", (shape.vocab, h), bf,
                            _uniform((shape.vocab, h), bf, WEIGHT_STD, "lm_head.weight", seed)))
    return specs


# --- checkpoint folders ---------------------------------------------------------------------

def quantization_config(kind: str, group_size: int | None = None) -> dict | None:
    if kind == "bf16":
        return None
    if kind == "gptq":
        from ..quantize import gptq
        return gptq.gptq_quantize_config(group_size or GPTQ_GROUP, 0.01)
    from ..quant_methods.config import MixPrecScheme  # noqa: PLC0415 (imports vLLM, no CUDA)
    kv = "kv4" if kind == "mixprec-kv4" else "none"
    d = MixPrecScheme(group_size=group_size or MIXPREC_GROUP, kv_scheme=kv).to_dict()
    d["calibration"] = {"method": "synthetic: random valid LiquidQuant tensors, no calibration"}
    return d


def _marker(shape: LlamaShape, kind: str, seed: int, group_size: int | None) -> dict:
    return {"kind": kind, "shape": dataclasses.asdict(shape), "seed": seed, "group_size": group_size,
            "quantization_config": quantization_config(kind, group_size)}


def is_current(folder: Path, marker: dict) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == json.loads(json.dumps(marker))
    except (OSError, ValueError):
        return False


def _atomic_folder(out: Path, write: Callable[[Path], None]) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_config(folder: Path, shape: LlamaShape, qcfg: dict | None, tokenizer_dir: Path) -> None:
    from ..quantize.export import TOKENIZER_FILES
    from ..quantize.models import fix_config

    llama_config(shape).save_pretrained(str(folder))
    if qcfg is not None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"] = qcfg
        (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if qcfg["quant_method"] == "gptq":  # AutoGPTQ's own file, read when config.json has none
            (folder / "quantize_config.json").write_text(json.dumps(qcfg, indent=2) + "\n")
    for fn in TOKENIZER_FILES:
        if (tokenizer_dir / fn).exists():
            shutil.copy2(tokenizer_dir / fn, folder / fn)
    fix_config(folder, shape.rope_theta)  # rope_theta / torch_dtype / tokenizer_class for vLLM


def build_checkpoint(out: str | os.PathLike, shape: LlamaShape, kind: str, tokenizer_dir: str | os.PathLike,
                     seed: int = 0, group_size: int | None = None, device: str | torch.device = "cpu",
                     shard_bytes: int = SHARD_BYTES) -> Path:
    """Write a random checkpoint of `kind` (bf16, gptq, mixprec) to `out`, atomically."""
    out, dev = Path(out), torch.device(device)
    marker = _marker(shape, kind, seed, group_size)

    def write(tmp: Path):
        write_shards(tmp, checkpoint_specs(shape, kind, seed, group_size), dev, shard_bytes)
        _write_config(tmp, shape, marker["quantization_config"], Path(tokenizer_dir))
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")

    return _atomic_folder(out, write)


def build_variant(src: str | os.PathLike, out: str | os.PathLike, kind: str) -> Path:
    """`src`'s tensors (hard links where the filesystem allows) under another quantization_config."""
    src, out = Path(src), Path(out)
    marker = json.loads((src / MARKER).read_text())
    marker["kind"] = kind
    marker["quantization_config"] = quantization_config(kind, marker["group_size"])

    def write(tmp: Path):
        for f in sorted(src.iterdir()):
            if f.name in ("config.json", MARKER) or not f.is_file():
                continue
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"] = marker["quantization_config"]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")

    return _atomic_folder(out, write)


def ckpt_dir(work: str | os.PathLike, shape: LlamaShape, kind: str, group_size: int | None = None) -> Path:
    g = group_size or (GPTQ_GROUP if kind == "gptq" else MIXPREC_GROUP)
    name = {"bf16": "bf16", "gptq": f"gptq-w4a16-g{g}", "mixprec": f"mixprec-w4a8-g{g}",
            "mixprec-kv4": f"mixprec-w4a8kv4-g{g}"}[kind]
    return Path(work) / shape.tag / name


def ensure_checkpoints(work: str | os.PathLike, shape: LlamaShape, kinds: Iterable[str], seed: int = 0,
                       mixprec_group: int = MIXPREC_GROUP, device: str = "cpu", log=print) -> dict[str, Path]:
    """Build whichever of `kinds` is missing or stale under work/<shape tag>/; returns kind -> folder."""
    kinds = list(dict.fromkeys(kinds))
    for k in kinds:
        if k not in CKPT_KINDS:
            raise ValueError(f"unknown checkpoint kind {k!r}; choose from {CKPT_KINDS}")
    work = Path(work)
    tok = work / "tokenizer"
    if not (tok / "tokenizer.json").exists():
        t0 = time.time()
        _atomic_folder(tok, lambda tmp: train_tokenizer(tmp, shape.vocab))
        log(f"tokenizer trained in {time.time() - t0:.1f} s -> {tok}")
    groups = {"bf16": None, "gptq": GPTQ_GROUP, "mixprec": mixprec_group, "mixprec-kv4": mixprec_group}
    out = {}
    order = sorted(kinds, key=lambda k: k == "mixprec-kv4")  # the variant after its source
    if "mixprec-kv4" in kinds and "mixprec" not in kinds:
        order.insert(0, "mixprec")
    for kind in order:
        g = groups[kind]
        folder = ckpt_dir(work, shape, kind, g)
        src_kind = "mixprec" if kind == "mixprec-kv4" else kind
        marker = _marker(shape, kind, seed, g)
        if is_current(folder, marker):
            log(f"{kind}: up to date at {folder}")
        else:
            t0 = time.time()
            if kind == "mixprec-kv4":
                build_variant(out["mixprec"], folder, kind)
            else:
                build_checkpoint(folder, shape, src_kind, tok, seed, g, device)
            size = sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".safetensors")
            log(f"{kind}: built in {time.time() - t0:.1f} s, {size / 2**30:.2f} GiB -> {folder}")
        out[kind] = folder
    return {k: out[k] for k in kinds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/mixprec-ab", help="checkpoints go to WORK/<shape tag>/<kind>")
    ap.add_argument("--layers", type=int, default=LLAMA3_8B.layers)
    ap.add_argument("--ckpts", default=",".join(CKPT_KINDS), help=f"comma list of {CKPT_KINDS}")
    ap.add_argument("--mixprec-group", type=int, default=MIXPREC_GROUP, choices=F.SUPPORTED_GROUP_SIZES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="where tensors are drawn: auto (cuda when present), cuda, cpu")
    ap.add_argument("--json", help="write {kind: folder} here")
    args = ap.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    shape = dataclasses.replace(LLAMA3_8B, layers=args.layers)
    t0 = time.time()
    dirs = ensure_checkpoints(args.work, shape, [k for k in args.ckpts.split(",") if k], args.seed,
                              args.mixprec_group, device)
    print(f"checkpoints ready in {time.time() - t0:.1f} s (tensors drawn on {device})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({k: str(v) for k, v in dirs.items()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
