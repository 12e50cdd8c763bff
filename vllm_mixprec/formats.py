"""The single definition of every packed layout in vllm_mixprec.

Everything that reads or writes packed bits (the quantizer, the checkpoint loader, the
Triton and CUDA kernels, the attention backend) follows the layouts defined here.
docs/FORMAT.md is the prose version of this file; keep the two in step.

Layouts
-------
W4 (LiquidQuant, "lqq") weights of a linear layer with W of shape [N, K] (out, in):
  * level 1: w8 = clamp(round(W / s1[n]), -119, 119), symmetric per output channel;
  * level 2: per group of G input channels, q = clamp(round((w8 - min) / s2), 0, 15)
    with an integer step s2 in [1, 16] and an offset a = 128 + min in [9, 247];
  * dequantisation is exact in 8-bit lanes: w8_hat = (q * s2 + a) ^ 0x80 (as int8).
  Tensors: qweight uint8 [N, K/2] (k even in the low nibble), group_scale uint8 [N, K/G],
  group_offset uint8 [N, K/G], channel_scale float32 [N].

A8 (W4A8): per-token symmetric int8 activations, scale = amax / 127. In their natural k order,
  or (a runtime layout, never stored) in the wgmma k order of wgmma_act_k_order: what the sm_90a
  wgmma kernels copy into shared memory as it is.
A8/A4 (W4Ax): channels permuted, then K is cut into ACT_BLOCK-channel blocks; the first
  num_a8_blocks are int8 (scale = block amax / 127), the rest 4-bit on the half-integer grid
  (A4_TOP: nibble q in [-8, 7] stands for (q + 1/2) * scale, scale = block amax / 7.5), two
  per byte (k even in the low nibble, two's complement nibbles). One scale per
  (token, block): float32 [M, num_a8_blocks] and [M, num_a4_blocks] (W4ActLayout).
  The permutation act_perm is stored as [K] channels; at run time one that moves whole blocks
  is held as [K/ACT_BLOCK] blocks (act_block_perm), so the quantizer reads an index a block.
  act_rotation "hadamard": before quantization each 4-bit block is multiplied by the
  orthonormal Hadamard matrix hadamard(ACT_BLOCK) (x_b <- x_b H); the exporter stored that
  block's weight columns as W_b H, so x_b H (W_b H)^T = x_b W_b^T and the GEMM is unchanged.
  The 8-bit blocks are not rotated (they hold the outlier channels on purpose).
  act_rotation "hadamard64": the same with hadamard(64) on each 64-channel half of a block (the
  block-diagonal [[H64, 0], [0, H64]]), so a rotated channel mixes only the channels of its own
  64-column weight group (group size 64): still one 4-bit scale per 128 channels.

KV pages: see KVPageLayout.
"""
from __future__ import annotations

import dataclasses
import math
import struct
from typing import NamedTuple

import torch

# --- weights ---------------------------------------------------------------------------

W8_PROTECT = 119  # QoQ protective range: (q*s + a) never leaves a byte lane (see FORMAT.md)
W4_MAX = 15
MAX_GROUP_STEP = 16  # ceil(2 * 119 / 15)
SUPPORTED_GROUP_SIZES = (64, 128)
ACT_BLOCK = 128  # W4Ax precision block along K (COMET)
A8_CHUNK = 64  # per-(token, chunk) int8 scales of the decode GEMM's in-register quantization (proposed: csrc/gemm/NOTES.md)
A8_MAX = 127
# The 4-bit activation grid (W4Ax): the 16 half-integers -7.5..7.5 times the block's scale
# max|x_block| / A4_TOP; the stored nibble q in [-8, 7] stands for q + 1/2. All 16 patterns are
# levels (an integer grid -7..7 leaves -8 unused) and none is zero; on near-Gaussian rotated
# blocks the mean squared error is ~15 % lower, and lcet10's W4Ax Δppl fell from +10.62 % to
# +10.02 % (W4A8 +7.96 %; docs/BENCHMARKS.md, session 30). Kernels widen q to the int8 lane
# 16 q + 8 = 8 (2 q + 1), i.e. the high nibble q and a low nibble of 8.
A4_MAX = 7
A4_TOP = A4_MAX + 0.5

# The wgmma k order of int8 activations: the sm_90a GEMM reads its B tile in the logical k order
# of the packed weights' k permutation (csrc/gemm/NOTES.md "Layout"), which puts actual 4-byte
# unit 4a + b of every 64 k at logical unit 4b + a. A quantizer that writes its codes there
# (quantize_act(..., wgmma_order=True)) lets the GEMM copy x by TMA instead of 4-byte cp.async.
# As tensor ops: a row [k] viewed as WGMMA_ORDER_VIEW(k) = [k / 64 chunks][4 a][4 b][4 bytes], then
# permuted by WGMMA_ORDER_PERMUTE (swap a and b). compile_passes.WgmmaActOrder emits these ops.
WGMMA_ORDER_CHUNK = 64
WGMMA_ORDER_PERMUTE = (0, 2, 1, 3)
WGMMA_ORDER_ROWS_PERMUTE = (0, *(d + 1 for d in WGMMA_ORDER_PERMUTE))  # rows [M, k] as [M, *view]


def wgmma_order_view(k: int) -> tuple[int, int, int, int]:
    check_divisible("K (wgmma k order)", k, WGMMA_ORDER_CHUNK)
    return (k // WGMMA_ORDER_CHUNK, 4, 4, 4)


def wgmma_act_k_order(k: int) -> torch.Tensor:
    """int64 [k]: x_wgmma = x[..., order] puts int8 activations [.., k] in the wgmma k order
    (a 4 x 4 transpose of 4-byte units in every 64 k; an involution, so x = x_wgmma[..., order]).
    Mirrors wgmma_act_k in csrc/gemm/w4a8_gemm.h."""
    return torch.arange(k).view(wgmma_order_view(k)).permute(WGMMA_ORDER_PERMUTE).reshape(k)


WEIGHT_SCHEMES = ("w4a8", "w4ax")
ACT_ROTATIONS = ("none", "hadamard", "hadamard64")  # W4Ax: what multiplies each 4-bit activation block
KV_SCHEMES = ("none", "kv8", "kv4")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., K] values in [0, 15] (any int dtype) -> uint8 [..., K/2]; even k in the low nibble."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dim {q.shape[-1]} is odd")
    q = q.to(torch.uint8)
    return (q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] in [0, 15]; inverse of pack_nibbles."""
    p = p.to(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def pack_int4(v: torch.Tensor) -> torch.Tensor:
    """Signed values in [-8, 7] -> uint8 [..., K/2] of two's complement nibbles."""
    return pack_nibbles(v.to(torch.int16) & 0xF)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> int8 [..., K] in [-8, 7]; inverse of pack_int4."""
    u = unpack_nibbles(p).to(torch.int16)
    return torch.where(u >= 8, u - 16, u).to(torch.int8)


def lqq_dequant_lanes(q: torch.Tensor, step: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """LiquidQuant level-2 dequantisation in uint8 arithmetic: ((q*step + offset) ^ 0x80) as int8.

    q, step, offset broadcast together; every intermediate must fit a byte, which
    `lqq_param_errors` checks for a whole layer. This is the exact bit recipe the kernels use (IMAD + XOR).
    """
    s = q.to(torch.int32) * step.to(torch.int32) + offset.to(torch.int32)
    return (s ^ 0x80).to(torch.uint8).view(torch.int8)


def lqq_dequant_packed_word(word: int, step: int, offset: int) -> int:
    """The 32-bit register recipe: 4 byte lanes q0..q3 -> 4 int8 lanes (as a uint32).

    r = word * step + offset * 0x01010101 ; r ^= 0x80808080. Correct only when no lane carries.
    """
    r = (word * step + offset * 0x01010101) & 0xFFFFFFFF
    return r ^ 0x80808080


W4_OFFSET_RANGE = (128 - W8_PROTECT, 128 + W8_PROTECT)  # a = 128 + min, min in [-119, 119]


def lqq_group_max_code(qweight: torch.Tensor, num_groups: int) -> torch.Tensor:
    """uint8 [N, num_groups]: the largest 4-bit code q of each group of a packed qweight."""
    n = qweight.shape[0]
    q = torch.maximum(qweight & 0xF, qweight >> 4)  # both nibbles of a byte share a group
    return q.reshape(n, num_groups, -1).amax(-1)


def lqq_param_errors(qweight: torch.Tensor, group_scale: torch.Tensor,
                     group_offset: torch.Tensor) -> list[str]:
    """What is wrong with a layer's packed LiquidQuant tensors (empty list: nothing).

    The kernels compute q*step + offset in 8-bit lanes: a value above 255 carries into the
    next weight and silently corrupts it. A correct exporter never writes one (FORMAT.md),
    so a checkpoint that has one is refused at load instead of serving wrong numbers.
    """
    errs = []
    if group_scale.numel():
        lo, hi = int(group_scale.min()), int(group_scale.max())
        if lo < 1 or hi > MAX_GROUP_STEP:
            errs.append(f"group_scale has values outside [1, {MAX_GROUP_STEP}] (found [{lo}, {hi}])")
    if group_offset.numel():
        lo, hi = int(group_offset.min()), int(group_offset.max())
        if lo < W4_OFFSET_RANGE[0] or hi > W4_OFFSET_RANGE[1]:
            errs.append(f"group_offset has values outside [{W4_OFFSET_RANGE[0]}, "
                        f"{W4_OFFSET_RANGE[1]}] (found [{lo}, {hi}])")
    if qweight.numel() and group_scale.numel():
        top = (lqq_group_max_code(qweight, group_scale.shape[1]).to(torch.int32)
               * group_scale.to(torch.int32) + group_offset.to(torch.int32))
        bad = top > 255
        if bool(bad.any()):
            n, g = (int(i) for i in bad.nonzero()[0])
            errs.append(f"{int(bad.sum())} group(s) have q*group_scale + group_offset > 255 "
                        f"(first: row {n}, group {g}: {int(top[n, g])}), which overflows the "
                        "8-bit dequantization lanes")
    return errs


@dataclasses.dataclass(frozen=True)
class W4Layout:
    """Shapes and dtypes of one linear layer's packed W4 tensors (checkpoint layout)."""

    out_features: int  # N
    in_features: int  # K
    group_size: int

    def __post_init__(self):
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size={self.group_size} is not one of {SUPPORTED_GROUP_SIZES}")
        if self.in_features % self.group_size:
            raise ValueError(
                f"in_features={self.in_features} is not divisible by group_size={self.group_size}")

    @property
    def num_groups(self) -> int:
        return self.in_features // self.group_size

    def tensor_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        n, k, g = self.out_features, self.in_features, self.num_groups
        return {
            "qweight": ((n, k // 2), torch.uint8),
            "group_scale": ((n, g), torch.uint8),
            "group_offset": ((n, g), torch.uint8),
            "channel_scale": ((n,), torch.float32),
        }


@dataclasses.dataclass(frozen=True)
class W4ActLayout:
    """W4Ax activation split: the first k8 (permuted) channels are 8-bit, the rest 4-bit."""

    in_features: int
    num_a8_blocks: int

    def __post_init__(self):
        if self.in_features % ACT_BLOCK:
            raise ValueError(f"in_features={self.in_features} is not a multiple of {ACT_BLOCK} (W4Ax)")
        if not 0 <= self.num_a8_blocks <= self.in_features // ACT_BLOCK:
            raise ValueError(f"num_a8_blocks={self.num_a8_blocks} out of range for K={self.in_features}")

    @classmethod
    def from_k8(cls, in_features: int, k8: int) -> "W4ActLayout":
        """The layout whose 8-bit part is the first k8 channels (validated)."""
        if k8 % ACT_BLOCK:
            raise ValueError(f"k8={k8} is not a multiple of {ACT_BLOCK} (W4Ax block)")
        return cls(in_features, k8 // ACT_BLOCK)

    @property
    def k8(self) -> int:
        return self.num_a8_blocks * ACT_BLOCK

    @property
    def k4(self) -> int:
        return self.in_features - self.k8

    @property
    def num_a4_blocks(self) -> int:
        return self.k4 // ACT_BLOCK


def act_block_perm(perm: torch.Tensor) -> torch.Tensor | None:
    """W4Ax act_perm [K] as the block permutation it is, or None: int32 [K/ACT_BLOCK] whose
    entry b is the source block of permuted block b, when every permuted block is one whole
    source block with its channels in order (what `quantize --a8-select blocks`, the default,
    writes). A runtime form only: checkpoints keep the [K] channel permutation."""
    k = perm.numel()
    if k % ACT_BLOCK or perm.dim() != 1:
        return None
    blocks = perm.view(-1, ACT_BLOCK).long()
    first = blocks[:, 0]
    whole = (first % ACT_BLOCK == 0) & (blocks == first[:, None] + torch.arange(
        ACT_BLOCK, device=perm.device)).all(dim=1)
    return (first // ACT_BLOCK).to(torch.int32) if bool(whole.all()) else None


def act_perm_unit(perm: torch.Tensor, k: int) -> int:
    """Channels one entry of a runtime W4Ax act_perm stands for, over K = k: 1 ([k] channels)
    or ACT_BLOCK ([k/ACT_BLOCK] blocks, act_block_perm); ValueError for any other shape."""
    if perm.dim() == 1 and perm.numel() == k:
        return 1
    if k % ACT_BLOCK == 0 and perm.dim() == 1 and perm.numel() == k // ACT_BLOCK:
        return ACT_BLOCK
    raise ValueError(f"perm has shape {tuple(perm.shape)}; expected ({k},) channels or "
                     f"({k // ACT_BLOCK},) blocks of {ACT_BLOCK} (formats.act_block_perm) for K={k}")


ACT_PERM_FORMS = ("blocks", "channels")  # act_perm at run time: [K/ACT_BLOCK] or [K] entries


def random_act_perm(k: int, form: str, generator: torch.Generator | None = None,
                    device=None) -> torch.Tensor:
    """A random W4Ax act_perm in a runtime form (ACT_PERM_FORMS), int32, for benchmarks and
    tests: "blocks" moves whole blocks (a `--a8-select blocks` checkpoint, the default),
    "channels" any channel anywhere (`--a8-select channels`)."""
    if form not in ACT_PERM_FORMS:
        raise ValueError(f"act_perm form {form!r} is not one of {ACT_PERM_FORMS}")
    if form == "blocks":
        check_divisible("k", k, ACT_BLOCK)
    n = k // ACT_BLOCK if form == "blocks" else k
    return torch.randperm(n, generator=generator, device=device).to(torch.int32)


def act_channel_perm(perm: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [k] channel permutation from either runtime form of W4Ax act_perm (act_perm_unit)."""
    if act_perm_unit(perm, k) == 1:
        return perm.long()
    return (perm.long()[:, None] * ACT_BLOCK + torch.arange(ACT_BLOCK, device=perm.device)).reshape(k)


def hadamard(n: int = ACT_BLOCK) -> torch.Tensor:
    """float32 [n, n]: the Sylvester Hadamard matrix / sqrt(n) (symmetric and orthogonal, so
    it is its own inverse). Row i, column j is (-1)^popcount(i & j) / sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: n={n} is not a power of two")
    i = torch.arange(n)
    bits = torch.bitwise_and(i[:, None], i[None, :])
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(torch.float32) / math.sqrt(n)


def act_rotation_size(act_rotation: str) -> int:
    """The width n of the Hadamard transforms an ACT_ROTATIONS name applies to each 4-bit block:
    "hadamard" one over the whole ACT_BLOCK channels, "hadamard64" one over each 64-channel half,
    "none" 0."""
    if act_rotation not in ACT_ROTATIONS:
        raise ValueError(f"act_rotation {act_rotation!r} is not one of {ACT_ROTATIONS}")
    return {"none": 0, "hadamard": ACT_BLOCK, "hadamard64": ACT_BLOCK // 2}[act_rotation]


def hadamard_norm(n: int) -> float:
    """1 / sqrt(n) rounded to float32: the one multiply after the fast transform's butterflies
    (reference.hadamard_a4_blocks), exact for even powers of two (n = 64: 1/8). Plain Python, so
    that torch.compile traces it as a constant (a tensor's .item() would break the graph)."""
    return struct.unpack("f", struct.pack("f", 1.0 / math.sqrt(n)))[0]


def act_rotation_matrix(act_rotation: str) -> torch.Tensor | None:
    """The float32 [ACT_BLOCK, ACT_BLOCK] matrix of an ACT_ROTATIONS name (block-diagonal for
    "hadamard64"); None for "none". The quantizer folds it into the weights; activations are
    rotated by the fast transform of the same matrix (reference.hadamard_a4_blocks)."""
    n = act_rotation_size(act_rotation)
    return torch.block_diag(*[hadamard(n)] * (ACT_BLOCK // n)) if n else None


# --- KV cache pages --------------------------------------------------------------------

# vLLM 0.26 sizes pages from --kv-cache-dtype; these carriers give us the byte budget.
KV_CARRIER_DTYPE = {"kv4": "int4_per_token_head", "kv8": "int8_per_token_head"}
KV_SCHEME_OF_CARRIER = {v: k for k, v in KV_CARRIER_DTYPE.items()}


@dataclasses.dataclass(frozen=True)
class KVPageLayout:
    """Byte layout of one (block, kv_head) slab of the paged cache.

    vLLM hands the backend a cache of shape (num_blocks, H, B, row_bytes) with
    row_bytes = 2*(D/2 + 4) for int4_per_token_head and 2*(D + 4) for int8_per_token_head.
    We do not use rows: each (block, head) slab of B*row_bytes contiguous bytes holds planes,
    so that every plane is contiguous and 16-byte aligned for vector loads:

      kv4: [K codes B x D/2][V codes B x D/2][K scale f16 B][K zero f16 B][V scale f16 B][V zero f16 B]
           codes are unsigned nibbles (even d low), x_hat = code * scale + zero (per token, per head)
      kv8: [K codes B x D][V codes B x D][K scale f32 B][V scale f32 B]
           codes are int8, x_hat = code * scale (symmetric, per token, per head)
    """

    scheme: str
    head_dim: int
    block_size: int

    def __post_init__(self):
        if self.scheme not in ("kv4", "kv8"):
            raise ValueError(f"kv scheme {self.scheme!r} is not one of ('kv4', 'kv8')")
        if self.head_dim % 16:
            raise ValueError(f"head_dim={self.head_dim} is not a multiple of 16")

    @property
    def bits(self) -> int:
        return 4 if self.scheme == "kv4" else 8

    @property
    def code_bytes_per_token(self) -> int:
        return self.head_dim * self.bits // 8

    @property
    def row_bytes(self) -> int:
        """Bytes per (token, head) that vLLM allots: K+V codes plus 8 bytes of metadata."""
        return 2 * self.code_bytes_per_token + 8

    @property
    def slab_bytes(self) -> int:
        return self.block_size * self.row_bytes

    def plane_offsets(self) -> dict[str, int]:
        b, c = self.block_size, self.code_bytes_per_token
        off = {"k_codes": 0, "v_codes": b * c}
        base = 2 * b * c
        if self.scheme == "kv4":
            off.update(k_scale=base, k_zero=base + 2 * b, v_scale=base + 4 * b, v_zero=base + 6 * b)
        else:
            off.update(k_scale=base, v_scale=base + 4 * b)
        return off

    def cache_shape(self, num_blocks: int, num_kv_heads: int) -> tuple[int, int, int, int]:
        return (num_blocks, num_kv_heads, self.block_size, self.row_bytes)

    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.scheme == "kv4" else torch.int8


def kv_planes(cache: torch.Tensor, layout: KVPageLayout) -> dict[str, torch.Tensor]:
    """Views of the planes of a (num_blocks, H, B, row_bytes) cache; no copies.

    Returns k_codes/v_codes [nb, H, B, code_bytes] (uint8 for kv4, int8 for kv8) and
    scale/zero planes [nb, H, B] (float16 for kv4, float32 for kv8).
    """
    nb, h, b, row = cache.shape
    if b != layout.block_size or row != layout.row_bytes:
        raise ValueError(f"cache shape {tuple(cache.shape)} does not match {layout}")
    raw = cache.view(torch.uint8).reshape(nb, h, layout.slab_bytes)
    off, c = layout.plane_offsets(), layout.code_bytes_per_token
    code_dtype = torch.uint8 if layout.scheme == "kv4" else torch.int8
    meta_dtype = torch.float16 if layout.scheme == "kv4" else torch.float32
    meta_bytes = 2 if layout.scheme == "kv4" else 4
    out = {}
    for name in ("k_codes", "v_codes"):
        out[name] = raw[:, :, off[name]: off[name] + b * c].view(code_dtype).view(nb, h, b, c)
    for name in [n for n in off if n.endswith(("scale", "zero"))]:
        out[name] = raw[:, :, off[name]: off[name] + b * meta_bytes].view(meta_dtype)
    return out


# --- bias-aware K (what the K planes hold for a model whose k projection has a bias) -------
#
# With a KRopeBias b (k_proj's bias of each kv head, the model's RoPE inverse frequencies),
# the K planes (and the 16-bit residual copy) of the token at cache position p hold
#     (K - RoPE_p(b)) / k_smooth        (k_smooth = 1 without SmoothAttention)
# and readers add q . RoPE_p(b) back to the scores. RoPE_p is neox style (rotate-half: d
# pairs with d + D/2) over the whole head, the angle of pair i being p * inv_freq[i], taken
# in fixed point: phase = p * steps[i] mod 2**32 in units of 2**-32 turns, steps[i] =
# round(inv_freq[i] / (2 pi) * 2**32) (exact integer arithmetic, so that every kernel computes
# the same angle at any p).
# `b` may keep only the largest rotary pairs of each head (make_k_rope_bias(num_pairs=...)):
# the others are zero in `bias`, and `pairs` lists the kept ones, all the readers visit.

ROPE_PHASE_BITS = 32
MIN_BIAS_PAIRS = 16  # the readers' bias dot has K = pairs: tensor cores need >= 16


def context_seqlens(seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    num_rows: int) -> torch.Tensor:
    """cu_seqlens_k [num_rows + 1] int32 of exact prefill's 16-bit context workspace
    (kernels/triton/context.py): a row of query length > 1 holds its whole sequence (cached
    context, then its new tokens), any other row only its new tokens (decode rows are
    attended from the pages by the decode kernel)."""
    qsl = query_start_loc[:num_rows + 1]
    qlens = (qsl[1:] - qsl[:-1]).to(torch.int32)
    klens = torch.where(qlens > 1, seq_lens[:num_rows].to(torch.int32), qlens)
    return torch.nn.functional.pad(torch.cumsum(klens, 0, dtype=torch.int32), (1, 0))


class KRopeBias(NamedTuple):
    """bias float32 [H_kv, D] (zero outside the kept pairs); inv_freq float32 [D/2];
    steps int64 [D/2] (rope_phase_steps); pairs int32 [H_kv, P] (kept pair indices i < D/2)."""

    bias: torch.Tensor
    inv_freq: torch.Tensor
    steps: torch.Tensor
    pairs: torch.Tensor


def rope_phase_steps(inv_freq: torch.Tensor) -> torch.Tensor:
    """Phase advance per position of each rotary pair, in units of 2**-32 turns (int64)."""
    turns = inv_freq.to(torch.float64) / (2 * math.pi)
    return torch.round(turns * 2.0 ** ROPE_PHASE_BITS).to(torch.int64) % (1 << ROPE_PHASE_BITS)


def make_k_rope_bias(bias: torch.Tensor, inv_freq: torch.Tensor,
                     num_pairs: int | None = None) -> KRopeBias:
    """Validated KRopeBias from k_proj's bias [H_kv, D] (or [H_kv * D], D = 2 * len(inv_freq)).

    num_pairs (None: all D/2) keeps, per head, the rotary pairs (d, d + D/2) of largest bias
    norm and zeroes the others; a power of two in [16, D/2].
    """
    half = inv_freq.numel()
    bias = bias.detach().to(torch.float32).reshape(-1, 2 * half).clone()
    inv_freq = inv_freq.detach().to(device=bias.device, dtype=torch.float32).contiguous()
    if not bool(torch.isfinite(bias).all()) or not bool(torch.isfinite(inv_freq).all()):
        raise ValueError("k_rope_bias: the k bias or the rotary frequencies hold NaN/Inf")
    if num_pairs is None or num_pairs >= half:
        pairs = torch.arange(half, device=bias.device).expand(bias.shape[0], half)
    else:
        if num_pairs < MIN_BIAS_PAIRS or num_pairs & (num_pairs - 1):
            raise ValueError(f"k_rope_bias: num_pairs={num_pairs} is not a power of two in "
                             f"[{MIN_BIAS_PAIRS}, {half}]")
        norm = bias[:, :half].square() + bias[:, half:].square()
        pairs = torch.topk(norm, num_pairs, dim=1).indices.sort(dim=1).values
        keep = torch.zeros_like(norm, dtype=torch.bool).scatter_(1, pairs, True)
        bias *= keep.repeat(1, 2)
    return KRopeBias(bias.contiguous(), inv_freq, rope_phase_steps(inv_freq),
                     pairs.to(torch.int32).contiguous())


def kv_capacity_ratio(scheme: str, head_dim: int) -> float:
    """Tokens per byte relative to a 16-bit cache."""
    row = KVPageLayout(scheme, head_dim, 16).row_bytes
    return (2 * 2 * head_dim) / row


def check_divisible(name: str, value: int, divisor: int) -> None:
    if value % divisor:
        raise ValueError(f"{name}={value} is not divisible by {divisor}")


assert math.ceil(2 * W8_PROTECT / W4_MAX) == MAX_GROUP_STEP
