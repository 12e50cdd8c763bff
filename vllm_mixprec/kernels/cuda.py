"""The csrc/ ops (TORCH_LIBRARY namespace `mixprec_C`), loaded from vllm_mixprec/_C*.so.

Loading the library does not initialise CUDA. `quantize_act` and `w4a8_gemm` have the
signatures of their counterparts in reference.py. `prepare_weights` repacks a layer's
checkpoint tensors once into the kernel layout (csrc/gemm/NOTES.md, "Layout"):

  qweight       uint8 [N, K/2]              -> uint8 [N/16, 8K]      (MMA-fragment order)
  group_scale   uint8 [N, K/G]  \\
  group_offset  uint8 [N, K/G]  /           -> group_scale := int32 [N/16, K/G, 8] words
                                               (scale, offset of two channels), group_offset := empty
  channel_scale float32 [N]                    (unchanged)

`w4a8_gemm` accepts either layout: checkpoint tensors are repacked on every call (tests,
one-off use), packed ones go straight to the kernel.
"""
from __future__ import annotations

import glob
import os

import torch

from .. import envs
from .. import formats as F

_LIB_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_state: dict = {}

# A/B and tuning: force a GEMM kernel and a split-K factor (0 auto). Kernel ids:
#   -1 auto: decode (M <= 64) / tiled mma.sync kernels, and on an sm_90 GPU whose build has them
#      the sm_90a wgmma kernels past M = 32 where the decode grid would take more than one wave,
#      and past M = 64 (decided in csrc/ops.cpp, so a dynamic M never branches in traced Python);
#   -2 auto over the mma.sync kernels only (MIXPREC_W4A8_WGMMA=0 selects it);
#   0/1 decode with 16/32 channels per CTA (M <= 64); 2/3 tiled with 64/128 tokens per CTA;
#   4/5/6/7/8 wgmma with 256 ch x 128 tok / 256 x 64 / 128 x 256 / 128 x 64 / 128 x 128 per CTA
#   (sm_90a).
_GEMM_KERNEL = envs.integer("MIXPREC_W4A8_KERNEL", -2, 8)
if _GEMM_KERNEL == -1 and not envs.flag("MIXPREC_W4A8_WGMMA"):
    _GEMM_KERNEL = -2
_GEMM_SPLITS = envs.integer("MIXPREC_W4A8_SPLITS", -2)

WGMMA_KERNELS = (4, 5, 6, 7, 8)
DECODE_MAX_M = 64  # mirrors kDecodeMaxM in csrc/gemm/sm80/w4a8_gemm_mma.cu (documentation and tests only)

CHUNK_K = 64  # k per packed chunk (two m16n8k32 steps)
TILE_N = 16  # output channels per MMA row tile


def _register_fakes() -> None:
    """Meta implementations, so torch.compile traces the ops without running them."""

    @torch.library.register_fake("mixprec_C::quantize_act")
    def _quantize_act_fake(x, smooth, wgmma_order=False):
        return (x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32))

    if hasattr(torch.ops.mixprec_C, "add_rms_norm_quantize_act"):
        @torch.library.register_fake("mixprec_C::add_rms_norm_quantize_act")
        def _add_rms_norm_quantize_act_fake(x, residual, weight, epsilon, smooth):
            return (x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32),
                    x.new_empty(x.shape))

    if hasattr(torch.ops.mixprec_C, "silu_mul_quantize_act"):
        @torch.library.register_fake("mixprec_C::silu_mul_quantize_act")
        def _silu_mul_quantize_act_fake(gate_up, smooth, max_cluster=SILU_QUANT_CLUSTER, cta_vecs=SILU_QUANT_CTA_VECS):
            m, k = gate_up.shape[0], gate_up.shape[1] // 2
            return gate_up.new_empty((m, k), dtype=torch.int8), gate_up.new_empty((m,), dtype=torch.float32)

    if hasattr(torch.ops.mixprec_C, "decode_kv4_pages"):  # (a build older than the op lacks it)
        @torch.library.register_fake("mixprec_C::decode_kv4_pages")
        def _decode_kv4_pages_fake(q, cache, block_table, seq_lens, query_start_loc, out, part_o,
                                   part_lse, k_smooth, qk_scale, num_rows, num_splits, slots,
                                   res_tokens, tile_tokens, min_tiles, prefetch_pages=0):
            return None

    @torch.library.register_fake("mixprec_C::w4a8_gemm")
    def _w4a8_gemm_fake(xq, x_scale, qweight, gparams, channel_scale, bias, out_dtype, kernel_id=-1, splits=0,
                        x_wgmma_order=False):
        return xq.new_empty((xq.shape[0], channel_scale.shape[0]), dtype=out_dtype)


def _load() -> None:
    if _state:
        return
    libs = sorted(glob.glob(os.path.join(_LIB_DIR, "_C*.so")))
    if not libs:
        _state["error"] = "no vllm_mixprec/_C*.so: build with `pip install -e .` where nvcc is present"
        return
    try:
        torch.ops.load_library(libs[0])
    except OSError as e:  # e.g. the CUDA runtime is missing on this machine
        _state["error"] = f"{libs[0]} failed to load: {e}"
        return
    _register_fakes()
    _state["path"] = libs[0]
    set_launch_options(**launch_options_from_env(os.environ))


# Environment variables that set a launch option when the library loads, and their values.
ENV_LAUNCH_OPTIONS = (("MIXPREC_GEMM_PDL", "gemm_pdl", range(2)),
                      ("MIXPREC_GEMM_STREAM_K", "gemm_stream_k", range(2)),
                      ("MIXPREC_GEMM_CLUSTER_PAIR", "gemm_cluster_pair", range(2)),
                      ("MIXPREC_GEMM_DECODE_U8", "decode_u8", range(2)),
                      ("MIXPREC_GEMM_DECODE_CTAS_PER_SM", "decode_ctas_per_sm", (0, 2, 3)),
                      ("MIXPREC_GEMM_DECODE_PRELOAD_MAX_M", "decode_preload_max_m", range(33)),
                      ("MIXPREC_GEMM_DECODE_DP4A", "decode_dp4a", range(2)),
                      ("MIXPREC_ACT_QUANT_SPLIT", "act_quant_split", (0, 1, 1024, 2048, 4096)),
                      ("MIXPREC_QUANT_OPS_PDL", "quant_ops_pdl", range(2)))


def launch_option_value(v: str, allowed) -> int | None:
    """v as one of a launch option's allowed values (ENV_LAUNCH_OPTIONS), None if it is not one."""
    return int(v) if v.isascii() and v.isdigit() and int(v) in allowed else None


def allowed_text(allowed) -> str:
    """A launch option's allowed values in words, for an error message."""
    if isinstance(allowed, range) and len(allowed) > 4:
        return f"an integer from {allowed[0]} to {allowed[-1]}"
    return f"{', '.join(map(str, allowed[:-1]))} or {allowed[-1]}"


def launch_options_from_env(environ) -> dict[str, int]:
    """The launch options that ENV_LAUNCH_OPTIONS' variables in environ ask for; a bad value raises."""
    options = {}
    for env, option, allowed in ENV_LAUNCH_OPTIONS:
        v = envs.explicit(env, environ)
        if v is not None:
            value = launch_option_value(v, allowed)
            if value is None:
                raise ValueError(f"{env}={v!r}: expected {allowed_text(allowed)}")
            options[option] = value
    return options


LAUNCH_OPTIONS = ("gemm_pdl", "act_quant_one_pass", "gemm_stream_k", "decode_u8", "decode_ctas_per_sm",
                  "decode_preload_max_m", "act_quant_lean", "gemm_cluster_pair", "decode_dp4a", "act_quant_split",
                  "quant_ops_pdl")


def set_launch_options(gemm_pdl: int = -1, act_quant_one_pass: int = -1, gemm_stream_k: int = -1,
                       decode_u8: int = -1, decode_ctas_per_sm: int = -1,
                       decode_preload_max_m: int = -1, act_quant_lean: int = -1,
                       gemm_cluster_pair: int = -1, decode_dp4a: int = -1,
                       act_quant_split: int = -1, quant_ops_pdl: int = -1) -> dict[str, int]:
    """Set the csrc launch options (-1 keeps one) and return them all.

    gemm_pdl: on sm_90 the decode GEMM (M <= 64) and the wgmma GEMMs are programmatic dependent
    launches, which quantize_act lets start at once (on; MIXPREC_GEMM_PDL=0 turns it off at load).
    act_quant_one_pass: quantize_act reads rows of up to 32K elements once, into registers (rows
    over 8192 only at M <= 128; on). act_quant_lean: that one-pass kernel multiplies by 1 / scale,
    dividing only near half-integers, for the same codes (on; 0: the per-element division, for A/B
    timing). gemm_stream_k: the wgmma planner may pick a stream-K launch,
    a persistent grid of one CTA per SM (data-parallel waves, then the rest of the tiles x K
    stages split evenly), when it estimates it 8 % faster (on; MIXPREC_GEMM_STREAM_K=0 turns it
    off at load). decode_u8: the decode GEMM (M <= 64) multiplies the unsigned weight bytes
    (u8 x s8 MMA, one XOR fewer per 4 weights) and subtracts 128 * sum_k x; the same int32 sums
    (off until timed on a GPU; MIXPREC_GEMM_DECODE_U8=1 turns it on at load).
    decode_ctas_per_sm: the decode kernels' build at M <= 16, registers capped for 2 CTAs per SM
    (<= 128) or 3 (<= 80: more CTAs resident, so fewer waves); 0 (default): the planner picks it
    with the kernel, fewest waves first; 2 or 3 forces one (MIXPREC_GEMM_DECODE_CTAS_PER_SM at
    load); M 17-64 always runs the 2-CTA build. decode_preload_max_m: at M <= this, each decode
    warp reads its first batch of weight words before the PDL wait, overlapping their DRAM latency
    with quantize_act; at M = 9-16 only in the 3-CTA build (half a batch in its 32-channel kernel)
    unless the bound is over 16 (16, the default, where it was measured faster; 0 never, 32 every
    decode M in every build; MIXPREC_GEMM_DECODE_PRELOAD_MAX_M at load). gemm_cluster_pair: the
    wgmma planner may run a tile's two K halves in a cluster of 2 CTAs, summed in shared memory,
    where the doubled grid is one wave, or, for K >= 8192, after a wave of whole tiles (on;
    MIXPREC_GEMM_CLUSTER_PAIR=0 turns it off at load). decode_dp4a: at M = 1 the decode kernels
    multiply the 4-bit codes by IDP.4A, with no dequant and no MMA, and apply each group's scale
    and offset once per group's share of a warp (two chunks at group >= 128); the planner picks the
    same build with it on or off, and the same int32 sums come out (on;
    MIXPREC_GEMM_DECODE_DP4A=0 turns it off at load). act_quant_split: quantize_act splits a few
    long rows over CTAs of one chunk each, every CTA taking the row's amax itself (unsmoothed,
    aligned rows; the same codes): 0 never, 1 the rule (the default: 4096 elements a CTA at M =
    9-32 where K >= 8192; quantize_act_split_chunk), 1024, 2048 or 4096 that chunk wherever M <= 64
    and the row makes two (A/B timing; MIXPREC_ACT_QUANT_SPLIT at load). quant_ops_pdl: on sm_90 the
    quantizer ops (quantize_act, add_rms_norm_quantize_act, silu_mul_quantize_act) are
    programmatic dependent launches, and the decode GEMM lets them launch once its CTAs are past
    their own wait, so an op after a GEMM is scheduled during the GEMM's last CTAs; they read
    nothing before waiting for the kernel before them; the same outputs (on;
    MIXPREC_QUANT_OPS_PDL=0 turns it off at load). Defaults: csrc/gemm/NOTES.md, "PDL",
    "Stream-K", "Decode u8", "Decode occupancy", "Decode preload", "quantize_act", "Session 47",
    "Session 48", "Session 55", "Session 56", "Session 80" and "Session 88".
    A CUDA graph keeps the options it was captured with."""
    got = torch.ops.mixprec_C.set_launch_options(gemm_pdl, act_quant_one_pass, gemm_stream_k, decode_u8,
                                                 decode_ctas_per_sm, decode_preload_max_m, act_quant_lean,
                                                 gemm_cluster_pair, decode_dp4a, act_quant_split, quant_ops_pdl)
    return dict(zip(LAUNCH_OPTIONS, got))


def available() -> bool:
    _load()
    return "path" in _state


def load_error() -> str | None:
    _load()
    return _state.get("error")


def supports_device(device: torch.device) -> bool:
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def has_wgmma(device: torch.device | int | None = None) -> bool:
    """Whether the sm_90a wgmma W4A8 kernels (ids 4..8) run on `device` (default: current).

    True only for an sm_90 GPU with a build that includes sm_90a; cached per device.
    """
    if not available() or not hasattr(torch.ops.mixprec_C, "w4a8_wgmma_available"):
        return False
    if not torch.cuda.is_available():
        return False
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "cuda":
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
    cache = _state.setdefault("wgmma", {})
    if index not in cache:
        cache[index] = bool(torch.ops.mixprec_C.w4a8_wgmma_available(index))
    return cache[index]


def quantize_act_split_chunk(m: int, k: int) -> int:
    """The chunk of a row that each CTA of quantize_act codes for M unsmoothed, 16-byte-aligned
    rows of K (K % 8 == 0) under the current act_quant_split option; 0: one CTA a row. Host code
    only, for tests and benchmarks; the op decides in C++ (csrc/quant/quantize_act_int8.cu)."""
    return int(torch.ops.mixprec_C.quantize_act_split_chunk(m, k))


def auto_gemm_kernel_family(m: int, n: int, k: int, device: torch.device | int | None = None,
                            num_sms: int | None = None) -> str:
    """Which family kernel=-1 runs for M tokens on an N x K weight: "decode", "mma" (tiled
    mma.sync) or "wgmma".

    For benchmarks, tests and the debug log; the op itself decides in C++ (csrc/ops.cpp).
    """
    if _GEMM_KERNEL >= 0:
        return "wgmma" if _GEMM_KERNEL in WGMMA_KERNELS else ("decode" if _GEMM_KERNEL < 2 else "mma")
    if _GEMM_KERNEL == -1 and has_wgmma(device):
        if num_sms is None:
            idx = torch.cuda.current_device() if device is None else torch.device(device).index
            num_sms = torch.cuda.get_device_properties(idx).multi_processor_count
        if not torch.ops.mixprec_C.w4a8_auto_decode(m, n, k, num_sms):
            return "wgmma"
    return "decode" if m <= DECODE_MAX_M else "mma"


def describe_plans(n: int, k: int, group_size: int, device: torch.device | int | None = None,
                   ms: tuple[int, ...] = (1, 16, 64, 256, 1024, 4096), num_sms: int | None = None) -> str:
    """What w4a8_gemm would launch for an N x K layer at each M in `ms`, on `device` (its SM
    count unless num_sms is given) with the current launch options and MIXPREC_W4A8_*
    overrides: "M=1024 wgmma k4 stream-K, ...". Host code only (the planner), for the debug log."""
    if num_sms is None:
        idx = torch.cuda.current_device() if device is None else torch.device(device).index
        num_sms = torch.cuda.get_device_properties(idx).multi_processor_count
    out = []
    for m in ms:
        family = auto_gemm_kernel_family(m, n, k, device, num_sms)
        kernel = _GEMM_KERNEL if _GEMM_KERNEL >= 0 else -1
        kid, splits, decode_ctas = torch.ops.mixprec_C.w4a8_plan(m, n, k, group_size, num_sms, kernel,
                                                                 _GEMM_SPLITS, family == "wgmma")
        how = {-1: "stream-K", -2: "cluster pair"}.get(splits, f"{splits} split{'s' if splits > 1 else ''}")
        build = f" ({decode_ctas} CTAs/SM)" if decode_ctas else ""
        out.append(f"M={m} {family} k{kid}{build} {how}")
    return ", ".join(out)


def has_w4ax() -> bool:
    return available() and hasattr(torch.ops.mixprec_C, "w4ax_gemm")


# --- layout -----------------------------------------------------------------------------

def _check_checkpoint_layout(qweight: torch.Tensor, group_scale: torch.Tensor,
                             group_offset: torch.Tensor) -> tuple[int, int, int]:
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be uint8 [N, K/2], got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if group_scale.dim() != 2 or group_scale.shape[0] != n or group_scale.shape[1] == 0:
        raise ValueError(f"group_scale must be [N={n}, K/G], got {tuple(group_scale.shape)}")
    if group_offset.shape != group_scale.shape:
        raise ValueError(f"group_offset {tuple(group_offset.shape)} does not match group_scale "
                         f"{tuple(group_scale.shape)}")
    if k % group_scale.shape[1]:
        raise ValueError(f"K={k} is not a multiple of the {group_scale.shape[1]} groups")
    g = k // group_scale.shape[1]
    if n % TILE_N:
        raise ValueError(f"the CUDA W4A8 kernel needs N (out_features) % {TILE_N} == 0, got N={n}")
    if g % CHUNK_K or (g // CHUNK_K) & (g // CHUNK_K - 1):
        raise ValueError(f"the CUDA W4A8 kernel needs a group size of 64 * 2^i, got K={k} / "
                         f"{group_scale.shape[1]} groups = {g}")
    return n, k, g


def repack_w4a8_reference(qweight: torch.Tensor, group_scale: torch.Tensor, group_offset: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint layout (formats.W4Layout) -> (qweight uint8 [N/16, 8K], gparams int32 [N/16, K/G, 8]).

    Pure torch on the tensors' device; the kernel reads exactly this. In the chunk of 16
    channels x 64 k of tile T, chunk c, lane l = 4g + t owns 16 bytes = four u32 words j:
    word j holds channel T*16 + 2g + (j&1) and k = c*64 + 16t + 8(j>>1) + [0, 8), byte b of it
    the nibble of k0 + b (low) and k0 + 4 + b (high). gparams[T, grp, g] is the bytes
    (scale, offset) of channel 2g then of 2g + 1.
    """
    n, k, _ = _check_checkpoint_layout(qweight, group_scale, group_offset)
    q = F.unpack_nibbles(qweight)  # [N, K]
    # n = T*16 + 2g + p ; k = c*64 + 16t + 8s + 4h + b
    q = q.view(n // TILE_N, 8, 2, k // CHUNK_K, 4, 2, 2, 4)  # T g p c t s h b
    q = q.permute(0, 3, 1, 4, 5, 2, 7, 6)  # T c g t s p b h
    packed = (q[..., 0] | (q[..., 1] << 4)).contiguous().view(n // TILE_N, k * 8)
    groups = group_scale.shape[1]
    s = group_scale.to(torch.uint8).view(n // TILE_N, 8, 2, groups).permute(0, 3, 1, 2)  # T grp g p
    a = group_offset.to(torch.uint8).view(n // TILE_N, 8, 2, groups).permute(0, 3, 1, 2)
    words = torch.stack((s, a), dim=-1).contiguous()  # T grp g p {scale, offset}
    gparams = words.view(n // TILE_N, groups, 8, 4).view(torch.int32).view(n // TILE_N, groups, 8)
    return packed, gparams


repack_w4a8 = repack_w4a8_reference  # the production repack is this torch code, run on the GPU


def unpack_w4a8_reference(packed: torch.Tensor, gparams: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of repack_w4a8_reference: -> (qweight [N, K/2], group_scale, group_offset [N, K/G])."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % (8 * CHUNK_K):
        raise ValueError(f"packed qweight must be uint8 [N/16, 8K] with K % 64 == 0, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    tiles, k = packed.shape[0], packed.shape[1] // 8
    if gparams.dtype != torch.int32 or gparams.dim() != 3 or gparams.shape[0] != tiles or gparams.shape[2] != 8:
        raise ValueError(f"gparams must be int32 [{tiles}, K/G, 8], got {gparams.dtype} {tuple(gparams.shape)}")
    n, groups = tiles * TILE_N, gparams.shape[1]
    b = packed.view(tiles, k // CHUNK_K, 8, 4, 2, 2, 4)  # T c g t s p b
    q = torch.stack((b & 0xF, b >> 4), dim=-1)  # T c g t s p b h
    q = q.permute(0, 2, 5, 1, 3, 4, 7, 6).contiguous().view(n, k)  # T g p c t s h b
    words = gparams.contiguous().view(torch.uint8).view(tiles, groups, 8, 2, 2)  # T grp g p {s, a}
    words = words.permute(0, 2, 3, 1, 4).contiguous().view(n, groups, 2)
    return F.pack_nibbles(q), words[..., 0].contiguous(), words[..., 1].contiguous()


def emulate_w4a8_dequant_reference(packed: torch.Tensor, gparams: torch.Tensor) -> torch.Tensor:
    """The int8 weights [N, K] as the kernel forms them, register by register.

    Follows csrc/gemm/sm80/w4a8_gemm_mma.cu:dequant_chunk on each lane's four u32 words
    (lo = w & 0x0F0F0F0F, hi = (w >> 4) & 0x0F0F0F0F, r = (x * s + a * 0x01010101) ^ 0x80808080
    in 32-bit arithmetic, carries included), places the bytes by the PTX fragment layout of
    mma.m16n8k32 A (register i: row g + 8*(i&1), col 4t + byte + 16*(i>>1)), and maps the
    MMA row to its channel (2*(r%8) + r//8) and the step's column to its k (the activation
    side loads x[k = c*64 + 16t + 8*step + 4*(col >= 16) + byte]). The CPU tests compare it
    with reference.dequantize_weight_w8.
    """
    tiles, k = packed.shape[0], packed.shape[1] // 8
    chunks, groups = k // CHUNK_K, gparams.shape[1]
    shift = (k // groups // CHUNK_K).bit_length() - 1
    words = packed.view(tiles, chunks, 32, 4, 4).to(torch.int64)  # T c lane j byte
    words = (words << (8 * torch.arange(4, device=packed.device))).sum(-1)  # T c lane j
    grp = torch.arange(chunks, device=packed.device) >> shift
    pw = gparams.to(torch.int64) & 0xFFFFFFFF  # T grp g
    pw = pw[:, grp]  # T c g
    pw = pw.repeat_interleave(4, dim=2)  # T c lane
    out = torch.empty(tiles * TILE_N, k, dtype=torch.int8, device=packed.device)
    lane = torch.arange(32, device=packed.device)
    g_of, t_of = lane // 4, lane % 4
    c_idx = torch.arange(chunks, device=packed.device)
    for j in range(4):
        parity, step = j & 1, j >> 1
        s = (pw >> (16 * parity)) & 0xFF
        a = ((pw >> (16 * parity + 8)) & 0xFF) * 0x01010101
        w = words[..., j]
        for half, x in ((0, w & 0x0F0F0F0F), (1, (w >> 4) & 0x0F0F0F0F)):
            r = ((x * s + a) & 0xFFFFFFFF) ^ 0x80808080  # the A register (4 int8 lanes)
            reg = 2 * half + parity  # a0: rows g, k 0..3 of the step; a1: rows g+8; a2/a3: k 16..
            row = g_of + 8 * (reg & 1)  # MMA row per lane
            channel = 2 * (row % 8) + row // 8
            for byte in range(4):
                val = ((r >> (8 * byte)) & 0xFF).to(torch.uint8).view(torch.int8)  # T c lane
                col = 4 * t_of + byte + 16 * (reg >> 1)  # logical k inside the k32 step
                # B fragment of that col holds x[c*64 + 16t + 8*step + 4*(col >= 16) + byte]
                kk = c_idx[:, None] * CHUNK_K + 16 * t_of[None, :] + 8 * step + 4 * (col[None, :] >= 16) + byte
                rows = torch.arange(tiles, device=packed.device)[:, None, None] * TILE_N + channel[None, None, :]
                out[rows.expand(tiles, chunks, 32), kk[None].expand(tiles, chunks, 32)] = val
    return out


# --- ops --------------------------------------------------------------------------------

def pack_weights(qweight: torch.Tensor, group_scale: torch.Tensor, group_offset: torch.Tensor,
                 channel_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> the kernel layout w4a8_gemm takes without repacking per call."""
    packed, gparams = repack_w4a8(qweight, group_scale, group_offset)
    return {"qweight": packed, "group_scale": gparams,
            "group_offset": torch.empty(0, dtype=torch.uint8, device=packed.device),
            "channel_scale": channel_scale.to(torch.float32).contiguous()}


def prepare_weights(layer: torch.nn.Module) -> None:
    """Repack the loaded checkpoint tensors into the kernel layout, once, on their device."""
    tensors = pack_weights(layer.qweight.data, layer.group_scale.data, layer.group_offset.data,
                           layer.channel_scale.data)
    for name, t in tensors.items():
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    layer.mixprec_cuda_layout = "w4a8_mma_v1"


def quantize_act(x: torch.Tensor, smooth: torch.Tensor | None = None, wgmma_order: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: x [M, K] -> (int8 [M, K], float32 scale [M]); wgmma_order:
    the codes in formats.wgmma_act_k_order (reference.quantize_act)."""
    return torch.ops.mixprec_C.quantize_act(x, smooth, wgmma_order)


NORM_QUANT_MAX_K = 16384  # kNormMaxK in csrc/gemm/w4a8_gemm.h


def has_norm_quant() -> bool:
    return available() and hasattr(torch.ops.mixprec_C, "add_rms_norm_quantize_act")


def norm_quant_supports(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                        smooth: torch.Tensor | None) -> bool:
    """Whether add_rms_norm_quantize_act's csrc kernel takes these tensors: fp16/bf16 rows of
    K % 8 == 0, at most NORM_QUANT_MAX_K, starting on 16-byte boundaries; residual and weight in
    x's dtype, smooth float32 (as served)."""
    def aligned(t):
        return t.data_ptr() % 16 == 0 and (t.dim() == 1 or (t.stride(1) == 1 and t.stride(0) % 8 == 0))

    k = x.shape[-1]
    return (x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16) and 0 < k <= NORM_QUANT_MAX_K
            and k % 8 == 0 and residual.dtype == x.dtype and residual.shape == x.shape
            and aligned(x) and aligned(residual)
            and (weight is None or (weight.dtype == x.dtype and weight.is_contiguous() and aligned(weight)))
            and (smooth is None or (smooth.dtype == torch.float32 and smooth.is_contiguous() and aligned(smooth))))


def add_rms_norm_quantize_act(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                              epsilon: float, smooth: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.add_rms_norm_quantize_act in one CUDA kernel (csrc/quant/add_rms_norm_quantize_act.cu)
    for the tensors norm_quant_supports takes: (int8 [M, K], float32 scale [M], residual [M, K])."""
    return torch.ops.mixprec_C.add_rms_norm_quantize_act(x, residual, weight, epsilon, smooth)


# silu_mul_quantize_act's kernel (csrc/gemm/w4a8_gemm.h, kSiluQuant*): a row's K outputs over a
# cluster of at most max_cluster CTAs (SILU_QUANT_CLUSTER by default, at most SILU_QUANT_MAX_CLUSTER;
# one before sm_90), about cta_vecs 8-element vectors a CTA (SILU_QUANT_CTA_VECS by default), at
# most SILU_QUANT_MAX_THREADS threads of SILU_QUANT_MAX_VECS vectors.
SILU_QUANT_MAX_CLUSTER = 16
SILU_QUANT_CLUSTER = 8
SILU_QUANT_CTA_VECS = 512
SILU_QUANT_MAX_THREADS = 1024
SILU_QUANT_MAX_VECS = 2
SILU_QUANT_MAX_CTA_VECS = SILU_QUANT_MAX_THREADS * SILU_QUANT_MAX_VECS
SILU_QUANT_MAX_ROWS = 65535


def silu_quant_args_ok(max_cluster: int, cta_vecs: int) -> bool:
    """Whether the csrc op takes this max_cluster (1 to SILU_QUANT_MAX_CLUSTER) and cta_vecs (1 to
    SILU_QUANT_MAX_CTA_VECS)."""
    return 1 <= max_cluster <= SILU_QUANT_MAX_CLUSTER and 1 <= cta_vecs <= SILU_QUANT_MAX_CTA_VECS


def silu_quant_plan(k: int, max_cluster: int = SILU_QUANT_CLUSTER,
                    cta_vecs: int = SILU_QUANT_CTA_VECS) -> tuple[int, int, int] | None:
    """csrc silu_mul_quantize_act_plan: (CTAs a row, threads a CTA, vectors a thread) for rows of
    k outputs, or None where the kernel does not take them or an argument is out of range."""
    if k <= 0 or k % 8 or not silu_quant_args_ok(max_cluster, cta_vecs):
        return None

    def cdiv(a, b):
        return -(-a // b)

    vecs = k // 8
    ctas = min(max_cluster, cdiv(vecs, cta_vecs))
    per_cta = cdiv(vecs, ctas)
    per_thread = cdiv(per_cta, SILU_QUANT_MAX_THREADS)
    if per_thread > SILU_QUANT_MAX_VECS:
        return None
    return ctas, cdiv(cdiv(per_cta, per_thread), 32) * 32, per_thread


# silu_quant_cluster_for's rule: about this many CTAs in all, at least 2 a row (H100, session 86,
# bf16 rows of 14336 and 28672 outputs, no smoothing: of clusters of 1, 2, 4 and 8, those of 8 / 4 /
# 2 were the fastest at M = 1 / 16 / 64, within 0.01 us; at M = 64 clusters of 8 took 8.4 and
# 11.5 us, of 2 5.3 and 7.8).
SILU_QUANT_TOTAL_CTAS = 64


def silu_quant_cluster_for(m: int, k: int) -> int:
    """max_cluster for M rows of k outputs: SILU_QUANT_TOTAL_CTAS // M CTAs a row (2 to
    SILU_QUANT_CLUSTER), raised to the fewest whose plan takes the row."""
    want = max(2, min(SILU_QUANT_CLUSTER, SILU_QUANT_TOTAL_CTAS // max(m, 1)))
    return next((c for c in range(want, SILU_QUANT_CLUSTER + 1) if silu_quant_plan(k, c) is not None),
                SILU_QUANT_CLUSTER)


def has_silu_quant() -> bool:
    return available() and hasattr(torch.ops.mixprec_C, "silu_mul_quantize_act")


def silu_quant_supports(gate_up: torch.Tensor, smooth: torch.Tensor | None,
                        clusters: bool | None = None) -> bool:
    """Whether silu_mul_quantize_act's csrc kernel takes these tensors: fp16/bf16 rows [M, 2K]
    starting on 16-byte boundaries, at most SILU_QUANT_MAX_ROWS of them, whose K outputs fit one
    cluster (silu_quant_plan; one CTA where not `clusters`, which defaults to gate_up's GPU being
    sm_90 or later); smooth float32 (as served)."""
    if not (gate_up.dim() == 2 and gate_up.dtype in (torch.float16, torch.bfloat16)
            and gate_up.shape[0] <= SILU_QUANT_MAX_ROWS and gate_up.shape[1] % 2 == 0):
        return False
    if clusters is None:
        clusters = torch.cuda.get_device_capability(gate_up.device)[0] >= 9
    k = gate_up.shape[1] // 2
    return (silu_quant_plan(k, SILU_QUANT_CLUSTER if clusters else 1) is not None
            and gate_up.data_ptr() % 16 == 0 and gate_up.stride(1) == 1 and gate_up.stride(0) % 8 == 0
            and (smooth is None or (smooth.dtype == torch.float32 and smooth.is_contiguous()
                                    and smooth.data_ptr() % 16 == 0)))


def silu_mul_quantize_act(gate_up: torch.Tensor, smooth: torch.Tensor | None = None,
                          max_cluster: int | None = None,
                          cta_vecs: int = SILU_QUANT_CTA_VECS) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.silu_mul_quantize_act in one CUDA kernel (csrc/quant/silu_mul_quantize_act.cu) for
    the tensors silu_quant_supports takes: gate_up [M, 2K] -> (int8 [M, K], float32 scale [M]).
    max_cluster: a row's CTAs at most (None: silu_quant_cluster_for's choice for the M rows);
    cta_vecs: about that many 8-element vectors a CTA (the benchmarks' A/B). One CTA a row on GPUs
    before sm_90."""
    if max_cluster is None:
        max_cluster = silu_quant_cluster_for(gate_up.shape[0], gate_up.shape[-1] // 2)
    return torch.ops.mixprec_C.silu_mul_quantize_act(gate_up, smooth, max_cluster, cta_vecs)


def x_wgmma_order_for(m: int, n: int, k: int, device: torch.device | int | None = None) -> bool:
    """Whether w4a8_gemm's own choice for M tokens on an N x K weight (kernel=-1, or the
    MIXPREC_W4A8_KERNEL override) is a wgmma kernel, which then reads x in the wgmma k order by
    TMA: 10-18 % faster at M >= 256 than its 4-byte copies of the natural order (H200,
    csrc/gemm/NOTES.md "Session 63"). Cached per shape: the eager linear asks on every call."""
    index = device.index if isinstance(device, torch.device) else device
    key = (m, n, k, index, _GEMM_KERNEL)
    got = _X_WGMMA_ORDER.get(key)
    if got is None:
        got = _X_WGMMA_ORDER[key] = k % CHUNK_K == 0 and auto_gemm_kernel_family(m, n, k, device) == "wgmma"
    return got


_X_WGMMA_ORDER: dict = {}  # x_wgmma_order_for's answers (not in _state: its being empty means "not loaded")


def w4a8_linear(x: torch.Tensor, qweight: torch.Tensor, group_scale: torch.Tensor,
                group_offset: torch.Tensor, channel_scale: torch.Tensor,
                bias: torch.Tensor | None = None, smooth: torch.Tensor | None = None) -> torch.Tensor:
    """quantize_act then w4a8_gemm (weights as w4a8_gemm takes them), x [M, K] -> [M, N] in x's
    dtype; the activations in the wgmma k order where the GEMM runs a wgmma kernel."""
    order = x_wgmma_order_for(x.shape[0], channel_scale.shape[0], x.shape[1], x.device)
    xq, xs = quantize_act(x, smooth, order)
    return w4a8_gemm(xq, xs, qweight, group_scale, group_offset, channel_scale, bias, x.dtype, order)


def has_decode_kv4() -> bool:
    """Whether the build holds the CUDA KV4 decode page kernel (csrc/attention/)."""
    return available() and hasattr(torch.ops.mixprec_C, "decode_kv4_pages")


def decode_kv4_pages(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor,
                     part_o: torch.Tensor | None, part_lse: torch.Tensor | None,
                     k_smooth: torch.Tensor | None, qk_scale: float, num_rows: int,
                     num_splits: int, slots: int, res_tokens: int, tile_tokens: int,
                     min_tiles: int, prefetch_pages: int = 0) -> None:
    """The page part of KV4 decode attention (csrc/attention/sm80/decode_kv4_mma.cu; head_dim
    128, 16-token pages, <= 8 query heads per kv head). qk_scale = softmax scale * log2(e).
    Split partials go to part_o/part_lse (row * slots + split), for the Triton finish kernel
    to merge; without them (one split, no residual) the rows' outputs go to `out`.
    prefetch_pages: each warp asks its page i + prefetch_pages into L2 at page i (0: off).
    kernels/triton/attention.py's decode_attention picks it (decode_impl)."""
    torch.ops.mixprec_C.decode_kv4_pages(q, cache, block_table, seq_lens, query_start_loc, out,
                                         part_o, part_lse, k_smooth, qk_scale, num_rows,
                                         num_splits, slots, res_tokens, tile_tokens, min_tiles,
                                         prefetch_pages)


def w4a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor,
              group_scale: torch.Tensor, group_offset: torch.Tensor, channel_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
              x_wgmma_order: bool = False) -> torch.Tensor:
    """y[m, n] = x_scale[m] * channel_scale[n] * sum_k xq[m, k] * w8[n, k] + bias[n].

    qweight/group_scale/group_offset in the checkpoint layout (repacked here, per call) or
    as prepare_weights left them (group_scale is then the int32 gparams, group_offset unused).
    x_wgmma_order: xq is in the wgmma k order (quantize_act(..., wgmma_order=True)); the call
    must then run a wgmma kernel (x_wgmma_order_for), or the op raises.
    """
    if group_scale.dtype != torch.int32:
        qweight, group_scale = repack_w4a8(qweight, group_scale, group_offset)
    if channel_scale.dtype != torch.float32:
        channel_scale = channel_scale.float()
    return torch.ops.mixprec_C.w4a8_gemm(xq, x_scale, qweight, group_scale, channel_scale, bias,
                                         out_dtype, _GEMM_KERNEL, _GEMM_SPLITS, x_wgmma_order)
