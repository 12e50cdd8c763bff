"""Model folders and texts for the offline GPU host, in parts that each fit one device call.

  python -m vllm_mixprec.eval.modelpack pack --out .gpu/models [--part-mib 60] \
      --item DEST=SRC ... [--gguf DEST=FILE.gguf ...]      # here (`make gpu-models`)
  python3 -m vllm_mixprec.eval.modelpack stash PARTDIR [--dest /root/mixprec-models]   # on the host
  python3 -m vllm_mixprec.eval.modelpack assemble [--dest /root/mixprec-models]        # on the host

An item is a folder or a file, written to DEST under --dest on the host. Every file is rebuilt
from segments, each checked when packing by decoding it back:
  ["raw", STREAM, OFFSET, LENGTH]           bytes of a decompressed stream
  ["copy", PATH, OFFSET, LENGTH]            bytes of a file rebuilt before it (a tensor or file
                                            two folders share: the demo checkpoint's embedding)
  ["ggml", CODEC, STREAM, OFFSET, LENGTH]   GGML blocks (q4_1, q8_0, q4_k, q6_k, f32) decoded to bf16 with numpy:
                                            the bf16 SmolLM2 folder was converted from a Q4_1 GGUF,
                                            so its tensors are these blocks, bit for bit (checked
                                            per tensor when packing; a tensor that does not match
                                            is stored raw; q4_k/q6_k are Qwen2.5's Q4_K_M)
A safetensors file is its header (raw) and one segment per tensor; any other file is one raw
segment (or a copy). Each item's raw bytes are one xz stream; the streams, in item order, are
cut into chunks that fill parts of at most --part-mib MiB. Every part folder holds its chunks and
manifest.json, the whole plan: sha256 of every chunk, of every stream and of every rebuilt file.

`stash` checks a part's chunks and adds them to DEST/.parts (again: nothing to do; a part of
another pack replaces the older pack). `assemble` needs every chunk: it names the missing parts
and exits 3, or rebuilds each file, checks its sha256, and lists the folders. The host side needs
Python 3 and numpy only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import struct
import sys
from pathlib import Path

from ..quantize.models import sha256_file as sha256_path  # stdlib only: fine on the host

FORMAT = "mixprec-models/1"
MIB = 1 << 20
MANIFEST = "manifest.json"
MANIFEST_ROOM = 512 * 1024  # of each part, kept for manifest.json
DEFAULT_DEST = "/root/mixprec-models"
# bytes, elements per block
GGML_BLOCK = {"q4_1": (20, 32), "q8_0": (34, 32), "q4_k": (144, 256), "q6_k": (210, 256), "f32": (4, 1)}


class PackError(RuntimeError):
    pass


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


# --- GGML blocks -> bf16 (the host runs this) ----------------------------------------------------

def _bf16_bytes(x) -> bytes:
    """float32 array -> bf16 bytes, round to nearest even (torch's .to(torch.bfloat16) for finite values)."""
    import numpy as np

    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2").tobytes()


def decode_ggml(codec: str, data: bytes) -> bytes:
    """GGML blocks as gguf-py dequantizes them, in its float32 operation order, as bf16:
    d * q + m (q4_1), q * d (q8_0), (d * sc) * q - dmin * m (q4_k: 8 sub-blocks of 32 with 6-bit
    scales and mins), (d * sc) * q (q6_k: 16 sub-blocks of 16, 6-bit q - 32)."""
    import numpy as np

    if codec not in GGML_BLOCK:
        raise PackError(f"unknown GGML codec {codec!r}")
    size = GGML_BLOCK[codec][0]
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size % size:
        raise PackError(f"{codec}: {raw.size} bytes is not a whole number of {size}-byte blocks")
    blocks = raw.reshape(-1, size)
    if codec == "f32":
        return _bf16_bytes(blocks.view("<f4"))
    if codec == "q6_k":
        return _bf16_bytes(_decode_q6_k(blocks))
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)
    if codec == "q4_k":
        return _bf16_bytes(_decode_q4_k(blocks, d))
    if codec == "q8_0":
        return _bf16_bytes(blocks[:, 2:].view(np.int8).astype(np.float32) * d)
    m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
    qs = blocks[:, 4:]
    q = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=1).astype(np.float32)
    return _bf16_bytes((d * q) + m)


def _nibbles(packed, runs: int, width: int):
    """[n, runs * width] bytes -> [n, 2 * runs, width]: each run's low nibbles, then its high ones."""
    import numpy as np

    n = packed.shape[0]
    shifted = packed.reshape(n, runs, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (shifted & np.uint8(15)).reshape(n, 2 * runs, width)


def _decode_q4_k(blocks, d):
    """[n, 144] q4_k blocks (d, dmin, 12 bytes of packed 6-bit scales/mins, 128 of nibbles) -> [n, 256]."""
    import numpy as np

    n = blocks.shape[0]
    dmin = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
    s = blocks[:, 4:16]
    sc = np.concatenate([s[:, 0:4] & np.uint8(63), (s[:, 8:12] & np.uint8(15)) | ((s[:, 0:4] >> 6) << 4)], 1)
    mn = np.concatenate([s[:, 4:8] & np.uint8(63), (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    scale = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    offset = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 16:], 4, 32).astype(np.float32)
    return (scale * q - offset).reshape(n, 256)


def _decode_q6_k(blocks):
    """[n, 210] q6_k blocks (128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d) -> [n, 256]."""
    import numpy as np

    n = blocks.shape[0]
    d = blocks[:, 208:210].copy().view("<f2").astype(np.float32)
    scale = (d * blocks[:, 192:208].view(np.int8).astype(np.float32)).reshape(n, 16, 1)
    low = _nibbles(blocks[:, :128], 2, 64).reshape(n, 8, 32)
    high = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & np.uint8(3)).reshape(n, 8, 32)
    q = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, 16, 16).astype(np.float32)
    return (scale * q).reshape(n, 256)


# --- packing (here) -------------------------------------------------------------------------------

def read_safetensors_layout(data: bytes) -> tuple[int, list[tuple[str, str, list[int], int, int]]]:
    """(data start, [(name, dtype, shape, begin, end)] sorted by offset) of a safetensors file."""
    if len(data) < 8:
        raise PackError("too short for safetensors")
    n = struct.unpack("<Q", data[:8])[0]
    if 8 + n > len(data):
        raise PackError("safetensors header runs past the end")
    header = json.loads(data[8:8 + n])
    base = 8 + n
    tensors = sorted(((k, v["dtype"], v["shape"], base + v["data_offsets"][0], base + v["data_offsets"][1])
                      for k, v in header.items() if k != "__metadata__"), key=lambda t: t[3])
    return base, tensors


_LAYER_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_TOP_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str | None:
    """The llama.cpp name of a Hugging Face Llama/Qwen2 tensor."""
    if hf_name in _TOP_GGUF:
        return _TOP_GGUF[hf_name]
    parts = hf_name.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[-1] in ("weight", "bias"):
        mod = _LAYER_GGUF.get(".".join(parts[3:-1]))
        if mod:
            return f"blk.{parts[2]}.{mod}.{parts[-1]}"
    return None


class GGUFSource:
    """The tensors of a GGUF file as GGML block rows, with the head counts for llama's q/k row order."""

    def __init__(self, path: Path):
        import numpy as np
        from gguf import GGUFReader  # packing only (the dev extra); the host never reads a GGUF

        r = GGUFReader(str(path))
        self.tensors = {}
        for t in r.tensors:
            codec = t.tensor_type.name.lower()
            if codec not in GGML_BLOCK:
                continue
            rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
            self.tensors[t.name] = (codec, np.asarray(t.data).view(np.uint8).reshape(rows, -1))
        self.heads = sorted({int(f.parts[-1][0]) for k, f in r.fields.items()
                             if k.endswith((".attention.head_count", ".attention.head_count_kv"))})

    def row_orders(self, rows: int):
        """Identity, then the inverse of convert_hf_to_gguf's q/k permutation for each head count."""
        import numpy as np

        yield None
        for h in self.heads:
            if rows % (2 * h) == 0:
                yield np.arange(rows).reshape(h, rows // h // 2, 2).swapaxes(1, 2).reshape(-1)

    def encode(self, hf_name: str, want: bytes) -> tuple[str, bytes] | None:
        """(codec, block bytes) that decode_ggml turns into exactly `want`, or None."""
        g = self.tensors.get(gguf_name(hf_name) or "")
        if g is None:
            return None
        codec, rows = g
        for order in self.row_orders(rows.shape[0]):
            blocks = (rows if order is None else rows[order]).tobytes()
            if len(blocks) // GGML_BLOCK[codec][0] * GGML_BLOCK[codec][1] * 2 != len(want):
                return None
            if decode_ggml(codec, blocks) == want:
                return codec, blocks
        return None


class _Stream:
    def __init__(self, name: str):
        self.name, self.buf = name, bytearray()

    def add(self, data: bytes) -> tuple[int, int]:
        off = len(self.buf)
        self.buf += data
        return off, len(data)


def plan_item(dest: str, src: Path, stream: _Stream, seen: dict[str, list], done: dict[str, bytes],
              gguf: GGUFSource | None, log=print) -> list[dict]:
    """File entries of one item; raw bytes go to `stream`. seen: sha256 of a file or tensor ->
    ["copy", path, off, len] of where it was rebuilt first; done: rebuilt path -> bytes (checks)."""
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
    if not files:
        raise PackError(f"{src}: nothing to pack")
    entries = []
    for f in files:
        path = dest if not src.is_dir() else f"{dest}/{f.relative_to(src).as_posix()}"
        data = f.read_bytes()
        sha = sha256_bytes(data)
        stats = {"raw": 0, "copy": 0, "ggml": 0}
        if sha in seen:
            segs = [seen[sha]]
            stats["copy"] = len(data)
        elif f.suffix == ".safetensors":
            segs = _plan_safetensors(path, data, stream, seen, gguf, stats)
        else:
            segs = [["raw", stream.name, *stream.add(data)]]
            stats["raw"] = len(data)
        seen.setdefault(sha, ["copy", path, 0, len(data)])
        entries.append({"path": path, "size": len(data), "sha256": sha, "segments": segs})
        done[path] = data
        log(f"  {path}: {len(data) / MIB:.1f} MiB = " + ", ".join(f"{k} {v / MIB:.1f}" for k, v in stats.items() if v))
    return entries


def _plan_safetensors(path: str, data: bytes, stream: _Stream, seen: dict, gguf: GGUFSource | None,
                      stats: dict) -> list[list]:
    base, tensors = read_safetensors_layout(data)
    segs = [["raw", stream.name, *stream.add(data[:base])]]
    stats["raw"] += base
    pos = base
    for name, dtype, _shape, begin, end in tensors:
        if begin != pos:
            raise PackError(f"{path}: tensor {name} starts at {begin}, expected {pos} (gaps are not supported)")
        chunk = data[begin:end]
        key = sha256_bytes(chunk)
        enc = gguf.encode(name, chunk) if gguf is not None and dtype == "BF16" else None
        if key in seen:
            segs.append(seen[key])
            stats["copy"] += len(chunk)
        elif enc is not None:
            segs.append(["ggml", enc[0], stream.name, *stream.add(enc[1])])
            stats["ggml"] += len(chunk)
        else:
            segs.append(["raw", stream.name, *stream.add(chunk)])
            stats["raw"] += len(chunk)
        seen.setdefault(key, ["copy", path, begin, len(chunk)])
        pos = end
    if pos != len(data):
        segs.append(["raw", stream.name, *stream.add(data[pos:])])
        stats["raw"] += len(data) - pos
    return segs


def rebuild(entry: dict, streams: dict[str, bytes], built) -> bytes:
    """A file's bytes from its segments; built(path) -> bytes of a file rebuilt before."""
    out = bytearray()
    for seg in entry["segments"]:
        kind = seg[0]
        if kind == "raw":
            _, s, off, n = seg
            out += streams[s][off:off + n]
        elif kind == "copy":
            _, p, off, n = seg
            out += built(p)[off:off + n]
        elif kind == "ggml":
            _, codec, s, off, n = seg
            out += decode_ggml(codec, streams[s][off:off + n])
        else:
            raise PackError(f"{entry['path']}: unknown segment kind {kind!r}")
    return bytes(out)


def pack(items: list[tuple[str, Path]], out: Path, part_mib: float = 60.0, ggufs: dict[str, Path] | None = None,
         preset: int = 6, manifest_room: int = MANIFEST_ROOM, log=print) -> dict:
    """Write out/part1..partN; returns the manifest (without the per-part fields)."""
    ggufs = ggufs or {}
    unknown = sorted(set(ggufs) - {d for d, _ in items})
    if unknown:
        raise PackError(f"--gguf for {unknown}, which is not an --item")
    dests = [d for d, _ in items]
    if len(set(dests)) != len(dests) or any(d.startswith(("/", ".")) or ".." in d.split("/") for d in dests):
        raise PackError(f"item destinations must be distinct relative paths: {dests}")
    for _, src in items:
        if not src.exists():
            raise PackError(f"{src} does not exist")
    room = int(part_mib * MIB) - manifest_room
    if room <= 0:
        raise PackError(f"--part-mib {part_mib} leaves no room for data")
    seen, done, files, streams = {}, {}, [], []
    for i, (dest, src) in enumerate(items):
        log(f"{dest} <- {src}" + (f" (GGUF {ggufs[dest]})" if dest in ggufs else ""))
        stream = _Stream(f"s{i}")
        g = GGUFSource(ggufs[dest]) if dest in ggufs else None
        files += plan_item(dest, src, stream, seen, done, g, log)
        streams.append(stream)
    plain = {s.name: bytes(s.buf) for s in streams}
    for e in files:  # the whole plan decodes back to every file, bit for bit
        if sha256_bytes(rebuild(e, plain, done.__getitem__)) != e["sha256"]:
            raise PackError(f"{e['path']}: the plan does not rebuild it (a bug)")
    stream_meta, blobs = [], []
    for s in streams:
        xz = lzma.compress(plain[s.name], preset=preset)
        log(f"stream {s.name}: {len(s.buf) / MIB:.1f} MiB -> xz {len(xz) / MIB:.1f} MiB")
        stream_meta.append({"name": s.name, "size": len(s.buf), "sha256": sha256_bytes(plain[s.name]),
                            "xz_size": len(xz), "xz_sha256": sha256_bytes(xz), "chunks": []})
        blobs.append(xz)
    # fill parts in stream order; a chunk is the piece of one stream inside one part
    part, used, parts_data = 1, 0, {1: []}
    for meta, xz in zip(stream_meta, blobs):
        off = 0
        while off < len(xz):
            if used >= room:
                part, used = part + 1, 0
                parts_data[part] = []
            n = min(room - used, len(xz) - off)
            name = f"{meta['name']}.{len(meta['chunks']):03d}.xz"
            meta["chunks"].append({"file": name, "part": part, "size": n, "sha256": sha256_bytes(xz[off:off + n])})
            parts_data[part].append((name, xz[off:off + n]))
            used += n
            off += n
    plan = {"format": FORMAT, "streams": stream_meta, "files": files, "items": dests}
    plan["pack_id"] = sha256_bytes(json.dumps(plan, sort_keys=True).encode())[:16]
    plan["parts"] = part
    if out.exists():
        for old in out.glob("part*"):
            shutil.rmtree(old)
    for k, chunks in parts_data.items():
        d = out / f"part{k}"
        d.mkdir(parents=True)
        for name, blob in chunks:
            (d / name).write_bytes(blob)
        (d / MANIFEST).write_text(json.dumps({**plan, "part": k}, indent=0) + "\n")
        size = sum(p.stat().st_size for p in d.iterdir())
        if size > part_mib * MIB:
            raise PackError(f"{d} is {size / MIB:.2f} MiB, over --part-mib {part_mib} (the manifest grew?)")
        log(f"{d}: {size / MIB:.2f} MiB, {len(chunks)} chunk(s)")
    return plan


# --- the host side --------------------------------------------------------------------------------

def _read_manifest(path: Path) -> dict:
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PackError(f"{path}: no readable manifest ({e})") from e
    if m.get("format") != FORMAT:
        raise PackError(f"{path}: format {m.get('format')!r}, expected {FORMAT!r}")
    return m


def stash(part_dir: Path, dest: Path, log=print) -> dict:
    """Check one part's chunks and keep them in dest/.parts; returns the stored manifest."""
    m = _read_manifest(part_dir / MANIFEST)
    store = dest / ".parts"
    if (store / MANIFEST).is_file():
        old = _read_manifest(store / MANIFEST)
        if old["pack_id"] != m["pack_id"]:
            log(f"{store} holds pack {old['pack_id']}; replacing it with pack {m['pack_id']}")
            shutil.rmtree(store)
    store.mkdir(parents=True, exist_ok=True)
    mine = [c for s in m["streams"] for c in s["chunks"] if c["part"] == m["part"]]
    for c in mine:
        src, dst = part_dir / c["file"], store / c["file"]
        if not src.is_file() or sha256_path(src) != c["sha256"]:
            raise PackError(f"{src}: missing or not the chunk the manifest lists (sha256 differs)")
        if dst.is_file() and dst.stat().st_size == c["size"] and sha256_path(dst) == c["sha256"]:
            continue
        shutil.copyfile(src, dst.with_suffix(".tmp"))
        os.replace(dst.with_suffix(".tmp"), dst)
    (store / MANIFEST).write_text(json.dumps({k: v for k, v in m.items() if k != "part"}, indent=0) + "\n")
    have = parts_present(m, store)
    log(f"part {m['part']} of {m['parts']} (pack {m['pack_id']}) kept in {store}; parts here: "
        f"{sorted(have)}; missing: {sorted(set(range(1, m['parts'] + 1)) - have) or 'none'}")
    return m


def parts_present(m: dict, store: Path) -> set[int]:
    parts = {c["part"] for s in m["streams"] for c in s["chunks"]}
    missing = {c["part"] for s in m["streams"] for c in s["chunks"]
               if not ((store / c["file"]).is_file() and (store / c["file"]).stat().st_size == c["size"])}
    return parts - missing


def assemble(dest: Path, log=print) -> list[str]:
    """Rebuild every file under dest from dest/.parts; returns the rebuilt paths."""
    store = dest / ".parts"
    if not (store / MANIFEST).is_file():
        raise PackError(f"{store} has no manifest: stash the parts first (scripts/gpu_models.sh stash PARTDIR)")
    m = _read_manifest(store / MANIFEST)
    missing = sorted(set(range(1, m["parts"] + 1)) - parts_present(m, store))
    if missing:
        raise PackError(f"parts {missing} of {m['parts']} (pack {m['pack_id']}) were not stashed on this host: "
                        f"run `scripts/gpu_models.sh stash .gpu/models/partK` for each, then assemble")
    cache: dict[str, bytes] = {}

    def stream(name: str) -> bytes:
        if name not in cache:
            meta = next(s for s in m["streams"] if s["name"] == name)
            xz = bytearray()
            for c in meta["chunks"]:
                blob = (store / c["file"]).read_bytes()
                if sha256_bytes(blob) != c["sha256"]:
                    raise PackError(f"{store / c['file']}: sha256 differs from the manifest")
                xz += blob
            data = lzma.decompress(bytes(xz))
            if sha256_bytes(data) != meta["sha256"]:
                raise PackError(f"stream {name}: decompressed sha256 differs from the manifest")
            cache[name] = data
        return cache[name]

    class Streams(dict):
        def __missing__(self, key):
            return stream(key)

    files_read: dict[str, bytes] = {}

    def built(path: str) -> bytes:  # a "copy" source: a file rebuilt (or found) before
        if path not in files_read:
            files_read[path] = (dest / path).read_bytes()
        return files_read[path]

    out = []
    for e in m["files"]:
        target = dest / e["path"]
        if target.is_file() and target.stat().st_size == e["size"] and sha256_path(target) == e["sha256"]:
            out.append(e["path"])
            continue
        data = rebuild(e, Streams(), built)
        if sha256_bytes(data) != e["sha256"]:
            raise PackError(f"{e['path']}: rebuilt file's sha256 differs from the manifest")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        out.append(e["path"])
    for item in m["items"]:
        p = dest / item
        files = [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file())
        log(f"{p}: {len(files)} file(s), {sum(f.stat().st_size for f in files) / MIB:.1f} MiB, sha256 checked")
    return out


def _pairs(values: list[str], what: str) -> list[tuple[str, Path]]:
    out = []
    for v in values:
        dest, sep, src = v.partition("=")
        if not sep or not dest or not src:
            raise PackError(f"{what} {v!r} is not DEST=PATH")
        out.append((dest.strip("/"), Path(src).expanduser()))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="modelpack", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="write OUT/part1..N (here)")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--item", action="append", default=[], metavar="DEST=PATH", help="a folder or a file")
    a.add_argument("--gguf", action="append", default=[], metavar="DEST=FILE",
                   help="the GGUF an item's bf16 safetensors were converted from")
    a.add_argument("--part-mib", type=float, default=60.0)
    s = sub.add_parser("stash", help="keep one part on the host")
    s.add_argument("part", type=Path)
    s.add_argument("--dest", type=Path, default=Path(DEFAULT_DEST))
    b = sub.add_parser("assemble", help="rebuild the folders on the host from every stashed part")
    b.add_argument("--dest", type=Path, default=Path(DEFAULT_DEST))
    args = p.parse_args(argv)
    try:
        if args.cmd == "pack":
            if not args.item:
                p.error("pack needs at least one --item DEST=PATH")
            plan = pack(_pairs(args.item, "--item"), args.out, args.part_mib, dict(_pairs(args.gguf, "--gguf")))
            print(f"{plan['parts']} part(s) in {args.out} (pack {plan['pack_id']})")
        elif args.cmd == "stash":
            stash(args.part, args.dest)
        else:
            assemble(args.dest)
    except PackError as e:
        print(f"modelpack {args.cmd}: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
