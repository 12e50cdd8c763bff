"""The sm_90a wgmma W4A8 kernels (csrc/gemm/sm90/w4a8_gemm_wgmma.cu, op kernel ids 4..8).

CPU: `emulate_wgmma_cta` replays one CTA of the kernel byte by byte (the producer's 4-byte
cp.async transpose into the 128-byte-swizzled B tile, or the TMA box of x in the wgmma k
order, the descriptor addressing of each k32
step, the consumers' LDS + dequant into the wgmma A fragment, the accumulator layout and the
epilogue's (token, channel) mapping, the tile raster) with the kernel's own index formulas, so
an indexing slip shows up without a GPU. GPU (`pytest -m gpu`): integer-exact results against
reference.py for every wgmma kernel and split count, fp16/bf16 outputs, poisoned outputs,
CUDA graph replay, and the auto choice.
"""
import numpy as np
import pytest
import torch

from vllm_mixprec import reference as ref
from vllm_mixprec.kernels import cuda

from cuda_gemm_helpers import (DEV, _gen, capture_after_warmup, check_close, poison, random_act,
                               random_lqq, replays_with_new_inputs, skip_without_csrc_ops)

# kernel id -> (m64 blocks per consumer warpgroup, tokens per CTA); mirrors Wg4..Wg8.
CONFIGS = {4: (2, 128), 5: (2, 64), 6: (1, 256), 7: (1, 64), 8: (1, 128)}
RASTER_GROUP = 8


# --- CPU emulation of the kernel's indexing ------------------------------------------------

def _swizzle128(addr):
    """Hardware 128-byte swizzle of a shared address (atoms 1024-byte aligned): bits 4-6 ^= 7-9."""
    return addr ^ (((addr >> 7) & 7) << 4)


def _dequant_lane(word4, params):
    """csrc dequant_chunk for one lane: 4 u32 words + group word -> a[step][reg] (uint32)."""
    pb = [(params >> (8 * i)) & 0xFF for i in range(4)]  # s_even, a_even, s_odd, a_odd
    a = [[0] * 4 for _ in range(2)]
    for j in range(4):
        s, off = (pb[2], pb[3]) if j & 1 else (pb[0], pb[1])
        lo = word4[j] & 0x0F0F0F0F
        hi = (word4[j] >> 4) & 0x0F0F0F0F
        a[j >> 1][j & 1] = ((lo * s + off * 0x01010101) & 0xFFFFFFFF) ^ 0x80808080
        a[j >> 1][2 + (j & 1)] = ((hi * s + off * 0x01010101) & 0xFFFFFFFF) ^ 0x80808080
    return a


def _tile_of(block, tok_tiles, ch_tiles):
    span = RASTER_GROUP * ch_tiles
    grp, rem = divmod(block, span)
    in_grp = min(RASTER_GROUP, tok_tiles - grp * RASTER_GROUP)
    return grp * RASTER_GROUP + rem % in_grp, rem // in_grp


def _tma_box_sw128(xb, M, K, tok0, k0, ktok):
    """The bytes one 2-D TMA box (ktok rows x 128 B at (k0, tok0), SWIZZLE_128B) leaves in shared
    memory: box byte (r, c) at swizzle(128 r + c); rows past M and k past K are zeros."""
    out = np.zeros(ktok * 128, dtype=np.uint8)
    for r in range(min(ktok, M - tok0)):
        n = min(128, K - k0)
        src = (tok0 + r) * K + k0
        out[_swizzle128(128 * r + np.arange(n))] = xb[src:src + n]
    return out


def emulate_wgmma_cta(kernel, xq, packed, gparams, tok_tile, ch_tile, rng, x_by_tma=False):
    """int64 results {(tok, ch): acc} of one CTA, following the kernel's address arithmetic.
    x_by_tma: xq is in the wgmma k order and goes by TMA (the kXTma kernels)."""
    blocks, ktok = CONFIGS[kernel]
    R = 2 * blocks * 4  # row tiles per CTA
    M, K = xq.shape
    chunks, num_rt = K // 64, packed.shape[0]
    groups = gparams.shape[1]
    gshift = (chunks // groups).bit_length() - 1
    xb = xq.view(torch.uint8).numpy().reshape(-1)
    wb = packed.numpy().reshape(-1)
    pw_all = gparams.view(torch.int32).numpy().reshape(-1).astype(np.int64) & 0xFFFFFFFF
    tok0, rt0 = tok_tile * ktok, ch_tile * R
    rows_valid, rt_valid = min(ktok, M - tok0), min(R, num_rt - rt0)
    d = {(wgc, b): np.zeros((64, ktok), dtype=np.int64) for wgc in range(2) for b in range(blocks)}
    for st in range((chunks + 1) // 2):
        c0 = 2 * st
        # stale bytes where the kernel copies nothing: must never reach a stored result
        xs = rng.integers(0, 256, ktok * 128, dtype=np.uint8)
        ws = rng.integers(0, 256, R * 1024, dtype=np.uint8)
        ps = rng.integers(0, 256, R * 64, dtype=np.uint8)
        if x_by_tma:
            xs = _tma_box_sw128(xb, M, K, tok0, st * 128, ktok)
        for pt in range(128):  # producer warpgroup
            pw, lane = pt >> 5, pt & 31
            h, a_, b_ = lane >> 4, (lane & 15) >> 2, lane & 3
            off = [pw * 128 + 16 * ((4 * h + b_) ^ pw) + 4 * a_,
                   pw * 128 + 512 + 16 * ((4 * h + b_) ^ (pw + 4)) + 4 * a_]
            ok = c0 + h < chunks
            for i in range(ktok // 4 if not x_by_tma else 0):
                if pw + 4 * i >= rows_valid:
                    continue
                src = (tok0 + pw + 4 * i) * K + st * 128 + 4 * lane - (0 if ok else 64)
                dst = off[i & 1] + (i >> 1) * 1024
                xs[dst:dst + 4] = xb[src:src + 4] if ok else 0
            w_rt, w_cl = pt >> 6, (pt >> 5) & 1
            ok = c0 + w_cl < chunks
            for i in range(R // 2):
                if w_rt + 2 * i >= rt_valid:
                    continue
                src = ((rt0 + w_rt + 2 * i) * chunks + c0) * 512 + (pt & 63) * 16 - (0 if ok else 512)
                dst = pt * 16 + i * 2048
                ws[dst:dst + 16] = wb[src:src + 16] if ok else 0
            p_rt, p_cl = pt >> 2, (pt >> 1) & 1
            if pt < 4 * R and p_rt < rt_valid:
                c = c0 + p_cl
                ok = c < chunks
                src = (rt0 + p_rt) * groups * 8 + (pt & 1) * 4 + (((c if ok else c0) >> gshift) * 8)
                words = pw_all[src:src + 4] if ok else np.zeros(4, dtype=np.int64)
                ps[pt * 16:pt * 16 + 16] = np.array(words, dtype=np.uint32).view(np.uint8)
        for wgc in range(2):  # consumer warpgroups
            for cl in range(2):
                # B of each k32 step through the descriptor: start + (n // 8) * SBO + (n % 8) * 128 + k
                bmat = []
                for step in range(2):
                    start = cl * 64 + 32 * step
                    n = np.arange(ktok)[:, None]
                    k = np.arange(32)[None, :]
                    addr = start + (n // 8) * 1024 + (n % 8) * 128 + k
                    bmat.append(xs[_swizzle128(addr)].view(np.int8).astype(np.int64))  # [n, k]
                for b in range(blocks):
                    amat = [np.zeros((64, 32), dtype=np.int64) for _ in range(2)]
                    for warp in range(4):
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            base = ((wgc * blocks) * 4 + warp) * 1024 + lane * 16 + b * 4 * 1024 + cl * 512
                            word4 = [int(v) for v in ws[base:base + 16].view(np.uint32)]
                            pbase = ((wgc * blocks) * 4 + warp) * 64 + g * 4 + b * 4 * 64 + cl * 32
                            params = int(ps[pbase:pbase + 4].view(np.uint32)[0])
                            a = _dequant_lane(word4, params)
                            for step in range(2):
                                for r in range(4):  # wgmma A fragment (= mma.m16n8k32 A per warp)
                                    row = 16 * warp + g + 8 * (r & 1)
                                    for byte in range(4):
                                        v = (a[step][r] >> (8 * byte)) & 0xFF
                                        amat[step][row, 4 * t + byte + 16 * (r >> 1)] = v - 256 if v >= 128 else v
                    for step in range(2):
                        d[(wgc, b)] += amat[step] @ bmat[step].T
    out = {}
    for wgc in range(2):  # epilogue mapping
        for b in range(blocks):
            for warp in range(4):
                rt = rt0 + (wgc * blocks + b) * 4 + warp
                if rt >= num_rt:
                    continue
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    ch = rt * 16 + 2 * g
                    for j in range(ktok // 8):
                        for dd in range(2):
                            tok = tok0 + 8 * j + 2 * t + dd
                            if tok >= M:
                                continue
                            acc = d[(wgc, b)]  # register 4j + v0 + 2 v1 -> (m = 16w + g + 8 v1, n = 8j + 2t + v0)
                            out[(tok, ch)] = acc[16 * warp + g, 8 * j + 2 * t + dd]
                            out[(tok, ch + 1)] = acc[16 * warp + g + 8, 8 * j + 2 * t + dd]
    return out


def _random_lqq_cpu(n, k, g, gen):
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    s = torch.randint(1, 17, (n, k // g), generator=gen, dtype=torch.int32)
    room = 255 - 15 * s - 9
    a = 9 + (torch.rand((n, k // g), generator=gen) * (room + 1)).floor().to(torch.int32).clamp_max(room)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8), s.to(torch.uint8), a.to(torch.uint8)


@pytest.mark.parametrize("kernel,m,n,k,g", [
    (4, 70, 272, 320, 64),    # partial token tile, second channel tile has 1 of 16 row tiles, odd chunks
    (5, 64, 256, 256, 128),   # full tiles, G = 128
    (6, 9, 208, 192, 64),     # 256-token tile with 9 rows, partial channel tile (5 of 8), odd chunks
    (7, 100, 208, 320, 64),   # two 64-token tiles (36 rows in the second), 13 row tiles over 8-tile CTAs
    (8, 130, 144, 256, 128),  # 128-token tiles with 2 rows in the second, 9 row tiles, G = 128
])
def test_emulated_cta_matches_integer_gemm(kernel, m, n, k, g):
    gen = torch.Generator().manual_seed(kernel * 1000 + m)
    qw, gs, go = _random_lqq_cpu(n, k, g, gen)
    xq = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int32).to(torch.int8)
    packed, gparams = cuda.repack_w4a8_reference(qw, gs, go)
    expect = ref._int_gemm(xq, ref.dequantize_weight_w8(qw, gs, go)).to(torch.int64)  # [m, n]
    blocks, ktok = CONFIGS[kernel]
    tok_tiles, ch_tiles = -(-m // ktok), -(-(n // 16) // (2 * blocks * 4))
    rng = np.random.default_rng(0)
    got = torch.full((m, n), -(2 ** 40), dtype=torch.int64)
    seen = set()
    for block in range(tok_tiles * ch_tiles):
        tt, ct = _tile_of(block, tok_tiles, ch_tiles)
        seen.add((tt, ct))
        for (tok, ch), v in emulate_wgmma_cta(kernel, xq, packed, gparams, tt, ct, rng).items():
            got[tok, ch] = int(v)
    assert seen == {(a, b) for a in range(tok_tiles) for b in range(ch_tiles)}  # raster covers every tile once
    assert torch.equal(got, expect)


@pytest.mark.parametrize("kernel,m,n,k,g", [
    (4, 70, 144, 320, 64),    # partial token tile, odd chunks (the last box's second half past K)
    (7, 100, 208, 256, 128),  # two 64-token tiles, 36 rows in the second
])
def test_emulated_cta_with_x_by_tma_matches_integer_gemm(kernel, m, n, k, g):
    """x in formats.wgmma_act_k_order, copied by a plain swizzled TMA box: the same sums as the
    natural x through the 4-byte transpose (what quantize_act(..., wgmma_order=True) relies on)."""
    gen = torch.Generator().manual_seed(kernel * 7 + m)
    qw, gs, go = _random_lqq_cpu(n, k, g, gen)
    xq = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int32).to(torch.int8)
    packed, gparams = cuda.repack_w4a8_reference(qw, gs, go)
    expect = ref._int_gemm(xq, ref.dequantize_weight_w8(qw, gs, go)).to(torch.int64)
    xw = ref.to_wgmma_act_order(xq)
    assert not torch.equal(xw, xq)
    blocks, ktok = CONFIGS[kernel]
    tok_tiles, ch_tiles = -(-m // ktok), -(-(n // 16) // (2 * blocks * 4))
    rng = np.random.default_rng(1)
    got = torch.full((m, n), -(2 ** 40), dtype=torch.int64)
    for block in range(tok_tiles * ch_tiles):
        tt, ct = _tile_of(block, tok_tiles, ch_tiles)
        for (tok, ch), v in emulate_wgmma_cta(kernel, xw, packed, gparams, tt, ct, rng, x_by_tma=True).items():
            got[tok, ch] = int(v)
    assert torch.equal(got, expect)
    natural = emulate_wgmma_cta(kernel, xq, packed, gparams, 0, 0, rng, x_by_tma=True)  # the wrong order
    assert any(int(v) != int(expect[tok, ch]) for (tok, ch), v in natural.items())


def test_raster_covers_every_tile_once():
    for tok_tiles, ch_tiles in ((1, 1), (3, 5), (8, 112), (9, 7), (33, 112), (17, 2)):
        tiles = [_tile_of(b, tok_tiles, ch_tiles) for b in range(tok_tiles * ch_tiles)]
        assert sorted(tiles) == [(a, b) for a in range(tok_tiles) for b in range(ch_tiles)]


# --- stream-K schedule (mirrors the kernel's segment_at / sk_range_begin / sk_owner and the
# host's sk_dp_tiles_of / sk_slots_of) ---

def _sk_dp_tiles(tiles, ctas):
    """The tiles run data-parallel first: every whole wave but the last."""
    return (tiles // ctas - 1) * ctas if tiles >= 2 * ctas else 0


def _sk_begin(cta, units, ctas):
    return cta * units // ctas


def _sk_owner(u, units, ctas):
    return -(-(u + 1) * ctas // units) - 1


def _stream_k_segments(tiles, stages, ctas):
    """Per CTA, its segments in order: (tile, first stage, stages, role, slot), role one of
    'whole' (the tile in one piece), 'finisher' (sums the other pieces), 'piece' (writes slot).
    First the CTA's data-parallel tiles, then its run of the remaining tiles x stages units."""
    dp = _sk_dp_tiles(tiles, ctas)
    units = (tiles - dp) * stages
    out = []
    for c in range(ctas):
        segs = [(t, 0, stages, "whole", -1) for t in range(c, dp, ctas)]
        u, end = _sk_begin(c, units, ctas), _sk_begin(c + 1, units, ctas)
        while u < end:
            t = u // stages
            n = min(stages * (t + 1), end) - u
            fin = _sk_owner(t * stages, units, ctas)
            pieces = _sk_owner(t * stages + stages - 1, units, ctas) - fin + 1
            role = "whole" if pieces == 1 else ("finisher" if c == fin else "piece")
            segs.append((dp + t, u - t * stages, n, role, c - fin - 1 if role == "piece" else -1))
            u += n
        out.append(segs)
    return out


def _sk_slots(tiles, stages, ctas):
    """sk_slots_of: the longest run of CTA boundaries inside one tile (of the stream-K tiles)."""
    units, most, run, run_tile = (tiles - _sk_dp_tiles(tiles, ctas)) * stages, 0, 0, -1
    for c in range(1, ctas):
        b = _sk_begin(c, units, ctas)
        if b % stages == 0:
            continue
        run = run + 1 if b // stages == run_tile else 1
        run_tile = b // stages
        most = max(most, run)
    return most


@pytest.mark.parametrize("tiles,stages,ctas", [
    (192, 32, 132),   # 4096 x 6144 at M = 1024, kernel 4: 1.45 tiles a CTA
    (128, 32, 132),   # 4096 x 4096 at M = 256, kernel 7: under a tile a CTA
    (4, 64, 132),     # few tiles, deep K: ~33 pieces a tile
    (264, 16, 132),   # exactly two tiles a CTA: one data-parallel wave, then nothing cut
    (896, 64, 132),   # 8192 x 28672 at M = 1024, kernel 4: 5 data-parallel waves, then 1.79 tiles a CTA
    (400, 8, 132),    # one data-parallel wave, then 2.03 tiles a CTA
    (20, 5, 100),     # a stage a CTA (units <= SMs)
    (7, 3, 5), (1, 1, 1), (3, 7, 2), (1000, 9, 132),
])
def test_stream_k_schedule_covers_every_stage_once(tiles, stages, ctas):
    segs = _stream_k_segments(tiles, stages, ctas)
    dp = _sk_dp_tiles(tiles, ctas)
    assert dp % ctas == 0 and (dp == 0 or ctas <= tiles - dp < 2 * ctas)
    seen = np.zeros((tiles, stages), dtype=np.int64)
    slots = _sk_slots(tiles, stages, ctas)
    pieces = {}
    for c, cta_segs in enumerate(segs):
        assert cta_segs, "every CTA has work (the planner keeps ctas <= units)"
        for i, (tile, k0, n, role, slot) in enumerate(cta_segs):
            seen[tile, k0:k0 + n] += 1
            pieces.setdefault(tile, []).append((role, slot, k0, c))
            if role == "finisher":  # the tile's first stages, and the CTA's last segment
                assert k0 == 0 and i == len(cta_segs) - 1
            if tile < dp:  # data-parallel: whole tiles c, c + ctas, ... before the rest
                assert role == "whole" and tile == c + i * ctas
            if role == "piece":  # a later piece: the CTA's first stream-K segment, in a slot that exists
                assert i == dp // ctas and k0 > 0 and 0 <= slot < slots
    assert (seen == 1).all()
    for tile, ps in pieces.items():
        roles = sorted(r for r, *_ in ps)
        if len(ps) == 1:
            assert roles == ["whole"]
        else:  # one finisher; the pieces fill slots 0.. in CTA order
            assert roles.count("finisher") == 1
            assert sorted(sl for r, sl, *_ in ps if r == "piece") == list(range(len(ps) - 1))
    most = max(len(ps) for ps in pieces.values()) - 1
    assert slots == most, "sk_slots_of is exact: the workspace holds the most-cut tile"


def test_stream_k_sums_reproduce_the_gemm():
    """Summing each tile's pieces in the kernel's order gives the integer GEMM (a tile = 16
    channels x 8 tokens, a stage = 128 k here)."""
    gen = torch.Generator().manual_seed(3)
    m, n, k, ctas = 24, 48, 1280, 7
    x = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int64)
    w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int64)
    tok_tiles, ch_tiles, stages = m // 8, n // 16, k // 128
    out = torch.zeros(m, n, dtype=torch.int64)
    partial, finish = {}, []
    for cta_segs in _stream_k_segments(tok_tiles * ch_tiles, stages, ctas):
        for tile, k0, cnt, role, slot in cta_segs:
            tt, cc = divmod(tile, ch_tiles)
            ks = slice(128 * k0, 128 * (k0 + cnt))
            acc = x[8 * tt:8 * tt + 8, ks] @ w[16 * cc:16 * cc + 16, ks].T
            if role == "piece":
                partial[(tile, slot)] = acc
            elif role == "finisher":  # waits for the pieces (later CTAs' first segments)
                finish.append((tile, tt, cc, acc))
            else:
                out[8 * tt:8 * tt + 8, 16 * cc:16 * cc + 16] = acc
    assert len(finish) == len({t for t, _ in partial})
    for tile, tt, cc, acc in finish:
        out[8 * tt:8 * tt + 8, 16 * cc:16 * cc + 16] = acc + sum(v for (t, _), v in partial.items() if t == tile)
    assert torch.equal(out, x @ w.T)


def test_kernel_id_plumbing_without_gpu():
    assert set(cuda.WGMMA_KERNELS) == set(CONFIGS)
    if not torch.cuda.is_available():
        assert not cuda.has_wgmma()
        assert cuda.auto_gemm_kernel_family(4096, 4096, 4096) == "mma"
        assert cuda.auto_gemm_kernel_family(64, 4096, 4096) == "decode"


# --- GPU ------------------------------------------------------------------------------------



@pytest.fixture
def need_wgmma():
    skip_without_csrc_ops()
    if not cuda.has_wgmma(torch.device(DEV)):
        pytest.skip("no wgmma kernel here (needs an sm_90 GPU and an sm_90a build)")




def _exact(m, n, k, g, kernel, splits, seed):
    gen = _gen(seed)
    qw, gs, go, _ = random_lqq(n, k, g, gen)
    xq, _ = random_act(m, k, gen)
    acc = ref._int_gemm(xq, ref.dequantize_weight_w8(qw, gs, go))
    assert float(acc.abs().max()) < 2 ** 24
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    poison(m * n, torch.float32)
    y = torch.ops.mixprec_C.w4a8_gemm(xq, torch.ones(m, device=DEV), pq, gp, torch.ones(n, device=DEV), None,
                                      torch.float32, kernel, splits)
    torch.cuda.synchronize()
    return y, acc


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [4, 5, 6, 7, 8])
@pytest.mark.parametrize("m", [1, 8, 63, 64, 65, 127, 128, 129, 200, 257, 640])
def test_integer_exact_tiles_and_tails(need_wgmma, kernel, m):
    """N = 208 (13 row tiles: every CTA overhangs N), K = 576 (9 chunks: half a last stage)."""
    y, acc = _exact(m, 208, 576, 64, kernel, 1, seed=17 * m + kernel)
    assert torch.equal(y.double(), acc)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [4, 5, 6, 7, 8])
@pytest.mark.parametrize("n,k,g", [(256, 128, 64), (512, 1024, 128), (4096, 2048, 64), (272, 8192, 128)])
@pytest.mark.parametrize("splits", [1, 2, 3, 0, -1])
def test_integer_exact_shapes_and_splits(need_wgmma, kernel, n, k, g, splits):
    y, acc = _exact(192, n, k, g, kernel, splits, seed=n + k + 7 * kernel + splits)
    assert torch.equal(y.double(), acc)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [4, 5, 6, 7, 8])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias_dtype", [None, "same", torch.float32])
@pytest.mark.parametrize("m", [64, 300])
def test_float_outputs_match_reference(need_wgmma, kernel, out_dtype, bias_dtype, m):
    n, k, g = 528, 1536, 128
    gen = _gen(m + kernel * 3 + (0 if bias_dtype is None else 1))
    qw, gs, go, cs = random_lqq(n, k, g, gen)
    xq, xs = random_act(m, k, gen)
    bias = None
    if bias_dtype is not None:
        bias = torch.randn(n, generator=gen, device=DEV).to(out_dtype if bias_dtype == "same" else bias_dtype)
    y_ref = ref.w4a8_gemm(xq, xs, qw, gs, go, cs, bias, torch.float64)
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    poison(m * n, out_dtype)
    y = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, bias, out_dtype, kernel, 0)
    torch.cuda.synchronize()
    check_close(y, y_ref, out_dtype, check_rel=False)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [4, 5, 6, 7, 8])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_bit_identical_to_mma_sync_kernel(need_wgmma, kernel, out_dtype):
    """Same int32 sums and the same epilogue float ops: identical outputs to tiled kernel 3."""
    m, n, k, g = 333, 1040, 2048, 64
    gen = _gen(kernel)
    qw, gs, go, cs = random_lqq(n, k, g, gen)
    xq, xs = random_act(m, k, gen)
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    a = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, out_dtype, kernel, 0)
    b = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, out_dtype, 3, 1)
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [128, 1024])
def test_llama70b_up_proj_shape(need_wgmma, m):
    n, k = 28672, 8192
    gen = _gen(m)
    qw, gs, go, cs = random_lqq(n, k, 64, gen)
    xq, xs = random_act(m, k, gen)
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    poison(m * n, torch.bfloat16)
    y = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.bfloat16, -1, 0)
    torch.cuda.synchronize()
    check_close(y, ref.w4a8_gemm(xq, xs, qw, gs, go, cs, None, torch.float64), torch.bfloat16, check_rel=False)
    y4 = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.bfloat16, 3, 0)
    assert torch.equal(y, y4)


@pytest.mark.gpu
@pytest.mark.parametrize("m,width,family", [(32, 0, "decode"), (33, 0, "decode"), (64, 0, "decode"),
                                            (65, 0, "wgmma"), (1000, 0, "wgmma"), (32, 1, "decode"),
                                            (40, 1, "decode"), (64, 1, "decode"), (32, 2, "decode"),
                                            (40, 2, "wgmma"), (64, 2, "wgmma")])
def test_auto_picks_decode_or_wgmma(need_wgmma, m, width, family):
    """Auto takes the decode kernels to M = 32, and to M = 64 where a decode grid is one wave (2
    CTAs x SMs; 32 channels, width 1 here, only to K = 8192-10240); the wgmma kernels past that (width 2).
    The op runs what the family and its planner say: the same bits as that plan forced."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = (512, 16 * (2 * sms + 1), 32 * (2 * sms + 1))[width]
    assert cuda.auto_gemm_kernel_family(m, n, 1024) == family
    gen = _gen(3 + m)
    qw, gs, go, cs = random_lqq(n, 1024, 64, gen)
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    xq, xs = random_act(m, 1024, gen)
    poison(m * n, torch.float16)
    auto = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, -1, 0)
    kernel, splits, _ = torch.ops.mixprec_C.w4a8_plan(m, n, 1024, 64, sms, -1, 0, family == "wgmma")
    assert (kernel in cuda.WGMMA_KERNELS) == (family == "wgmma")
    assert family != "decode" or m <= 32 or kernel == min(width, 1)  # 32 channels where 16 is not one wave
    forced = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, kernel, splits)
    assert torch.equal(auto, forced)
    check_close(auto, ref.w4a8_gemm(xq, xs, qw, gs, go, cs, None, torch.float64), torch.float16, check_rel=False)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 1024, 4096), (200, 512, 1024), (1024, 4096, 1024)])
def test_cuda_graph_capture_and_replay(need_wgmma, m, n, k):
    """(64, 1024, 4096) takes split-K (the decode kernel at two splits since session 58; a wgmma
    kernel at four before): the counters' memset is captured too."""
    gen = _gen(42)
    qw, gs, go, cs = random_lqq(n, k, 64, gen)
    layer = torch.nn.Module()
    for name, t in (("qweight", qw), ("group_scale", gs), ("group_offset", go), ("channel_scale", cs)):
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    cuda.prepare_weights(layer)
    bias = torch.randn(n, device=DEV, dtype=torch.bfloat16)

    def f(x):
        xq, xs = cuda.quantize_act(x)
        return torch.ops.mixprec_C.w4a8_gemm(xq, xs, layer.qweight, layer.group_scale, layer.channel_scale,
                                             bias, torch.bfloat16, -1, 0)

    x_static = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    graph, y_static, _ = capture_after_warmup(f, x_static)
    for x_new in replays_with_new_inputs(graph, x_static, 100):
        assert torch.equal(y_static, f(x_new))
        xq, xs = cuda.quantize_act(x_new)
        check_close(y_static, ref.w4a8_gemm(xq, xs, qw, gs, go, cs, bias, torch.float64), torch.bfloat16, check_rel=False)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [4, 5, 7, 8])
@pytest.mark.parametrize("m", [1, 65, 200, 640])
def test_stream_k_integer_exact_tails(need_wgmma, kernel, m):
    """N = 208, K = 576 (5 stages, half a last one): at most a few hundred units, so every CTA
    holds a stage or two and tiles are cut into up to 5 pieces."""
    y, acc = _exact(m, 208, 576, 64, kernel, -1, seed=31 * m + kernel)
    assert torch.equal(y.double(), acc)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,kernel", [(1024, 4096, 6144, 4), (256, 4096, 4096, 7), (256, 4096, 6144, 8),
                                          (64, 14336, 4096, 5), (4096, 4096, 4096, 4), (300, 8192, 1040, 4),
                                          # hybrid: data-parallel waves, then cut tiles (ragged M and N)
                                          (2100, 4096, 6144, 4), (8200, 576, 400, 7)])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_stream_k_bit_identical_to_one_split(need_wgmma, m, k, n, kernel, out_dtype):
    """int32 sums are exact in any order: stream-K, one split and the auto plan agree bit for bit,
    bias included, on the Llama shapes where stream-K is meant to win."""
    _check_same_as_one_split(m, k, n, kernel, -1, out_dtype, group=64, seed=m + n + kernel)


def _check_same_as_one_split(m, k, n, kernel, splits, out_dtype, group, seed):
    """The launch of `splits` (-1 stream-K, -2 a cluster pair) against one split: bit for bit,
    bias included, and close to the float64 reference."""
    gen = _gen(seed)
    qw, gs, go, cs = random_lqq(n, k, group, gen)
    xq, xs = random_act(m, k, gen)
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    bias = torch.randn(n, generator=gen, device=DEV).to(out_dtype)
    poison(m * n, out_dtype)
    y = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, bias, out_dtype, kernel, splits)
    one = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, bias, out_dtype, kernel, 1)
    assert torch.equal(y, one)
    check_close(y, ref.w4a8_gemm(xq, xs, qw, gs, go, cs, bias, torch.float64), out_dtype, check_rel=False)


def _check_graph_replays_match_one_split(m, n, k, kernel, splits, group, seed, replays):
    """quantize_act + the launch of `splits`, captured (the GEMM as the quantizer's programmatic
    dependent) and replayed on new inputs: each replay equals an eager one-split launch."""
    gen = _gen(seed)
    qw, gs, go, cs = random_lqq(n, k, group, gen)
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    x_static = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)

    def f(x):
        xq, xs = cuda.quantize_act(x)
        return torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.bfloat16, kernel, splits)

    graph, y_static, _ = capture_after_warmup(f, x_static)
    for x_new in replays_with_new_inputs(graph, x_static, replays):
        xq, xs = cuda.quantize_act(x_new)
        one = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.bfloat16, kernel, 1)
        assert torch.equal(y_static, one)


@pytest.mark.gpu
def test_stream_k_cuda_graph_replays_reset_the_counters(need_wgmma):
    """The finisher zeroes its tile's counter: replays (and eager calls between them) stay exact."""
    _check_graph_replays_match_one_split(1024, 6144, 4096, 4, -1, group=64, seed=77, replays=200)


def _small_layer_at_m16(seed):
    """A 256 x 512 layer, repacked, and int8 activations of 16 tokens (a decode plan): for the
    refusals. Returns (pq, gp, cs, xq, xs, gen)."""
    gen = _gen(seed)
    qw, gs, go, cs = random_lqq(256, 512, 64, gen)
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    return (pq, gp, cs, *random_act(16, 512, gen), gen)


@pytest.mark.gpu
def test_stream_k_refused_off_the_wgmma_kernels(need_wgmma):
    pq, gp, cs, xq, xs, gen = _small_layer_at_m16(2)
    with pytest.raises(RuntimeError, match="stream-K"):
        torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, 3, -1)
    with pytest.raises(RuntimeError, match="stream-K"):  # auto at M = 16 is a decode kernel
        torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, -1, -1)
    with pytest.raises(RuntimeError, match="cluster pair"):
        torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, 3, -2)
    with pytest.raises(RuntimeError, match="splits must be"):
        torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, 4, -3)
    with pytest.raises(RuntimeError, match=r"a cluster pair\) runs on the wgmma kernels only"):  # M = 16: decode
        torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, -1, -2)
    xq65, xs65 = random_act(65, 512, gen)  # past the decode kernels' M: auto is a wgmma plan
    with pytest.raises(RuntimeError, match="needs a kernel id"):
        torch.ops.mixprec_C.w4a8_gemm(xq65, xs65, pq, gp, cs, None, torch.float16, -1, -2)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [4, 5, 6, 7, 8])
@pytest.mark.parametrize("m,n,k", [(1, 208, 576), (65, 208, 576), (200, 208, 576), (640, 208, 256),
                                   (192, 272, 8192), (130, 4096, 2048), (1100, 1040, 576)])
def test_cluster_pair_integer_exact(need_wgmma, kernel, m, n, k):
    """Two K halves a tile, summed in the cluster's shared memory: ragged M and N, odd chunk
    counts (K = 576: the second CTA's last stage is half a stage) and one stage a CTA (K = 256).
    With more tiles than half the SMs (1100 x 1040 on 132 SMs: kernels 5, 7, 8) the first tiles
    run whole, two a cluster, and the rest as pairs (kernel 8: 81 tiles, 14 whole, 67 pairs)."""
    y, acc = _exact(m, n, k, 64, kernel, -2, seed=13 * m + n + kernel)
    assert torch.equal(y.double(), acc)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,kernel", [(256, 4096, 4096, 8), (256, 4096, 6144, 4), (256, 4096, 4096, 7),
                                          (64, 14336, 4096, 5), (1024, 4096, 6144, 4), (1024, 4096, 6144, 8)])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_cluster_pair_bit_identical_to_one_split(need_wgmma, m, k, n, kernel, out_dtype):
    _check_same_as_one_split(m, k, n, kernel, -2, out_dtype, group=128, seed=m + n + kernel + 1)


@pytest.mark.gpu
def test_cluster_pair_cuda_graph_after_the_quantizer(need_wgmma):
    """A cluster launch with PDL, captured after the quantizer and replayed."""
    _check_graph_replays_match_one_split(256, 4096, 4096, 8, -2, group=128, seed=78, replays=50)
    # one wave of whole tiles, then the pairs (192 tiles of kernel 4)
    _check_graph_replays_match_one_split(1024, 6144, 4096, 4, -2, group=128, seed=79, replays=20)


@pytest.mark.gpu
def test_deterministic_split_k(need_wgmma):
    a, _ = _exact(128, 512, 8192, 64, 4, 7, seed=5)
    b, _ = _exact(128, 512, 8192, 64, 4, 7, seed=5)
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_wgmma_kernel_refused_where_unavailable():
    if not torch.cuda.is_available() or not cuda.available():
        pytest.skip("needs a CUDA GPU and the csrc ops")
    if cuda.has_wgmma(torch.device(DEV)):
        pytest.skip("wgmma available here")
    gen = _gen(1)
    qw, gs, go, cs = random_lqq(64, 128, 64, gen)
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    xq, xs = random_act(80, 128, gen)
    with pytest.raises(RuntimeError, match="wgmma kernel"):
        torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, 4, 0)
    # auto still works (mma.sync fallback)
    y = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, -1, 0)
    check_close(y, ref.w4a8_gemm(xq, xs, qw, gs, go, cs, None, torch.float64), torch.float16, check_rel=False)


# --- x in the wgmma k order (the kXTma kernels: x by TMA) -----------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [4, 5, 6, 7, 8])
@pytest.mark.parametrize("m", [1, 63, 65, 129, 257, 640])
@pytest.mark.parametrize("splits", [1, 2, -1, -2])
def test_x_wgmma_order_integer_exact(need_wgmma, kernel, m, splits):
    """N = 208 (every CTA overhangs N), K = 576 (the last TMA box is half past K), rows past M in
    the last token tile: the box's zero fill must stand in for the copies the cp.async path skips."""
    n, k = 208, 576
    gen = _gen(31 * m + kernel + splits)
    qw, gs, go, _ = random_lqq(n, k, 64, gen)
    xq, _ = random_act(m, k, gen)
    acc = ref._int_gemm(xq, ref.dequantize_weight_w8(qw, gs, go))
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    poison(m * n, torch.float32)
    y = torch.ops.mixprec_C.w4a8_gemm(ref.to_wgmma_act_order(xq), torch.ones(m, device=DEV), pq, gp,
                                      torch.ones(n, device=DEV), None, torch.float32, kernel, splits, True)
    torch.cuda.synchronize()
    assert torch.equal(y.double(), acc)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(256, 4096, 6144), (1024, 4096, 4096), (300, 14336, 4096), (129, 8192, 28672)])
def test_x_wgmma_order_auto_plan_bit_identical(need_wgmma, m, k, n):
    """The auto plan (stream-K, cluster pairs, splits) on x in the wgmma order: the same bits as
    on the natural order; and the linear (cuda.w4a8_linear) picks that order by itself."""
    gen = _gen(m + n)
    qw, gs, go, cs = random_lqq(n, k, 128, gen)
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    assert cuda.x_wgmma_order_for(m, n, k)
    xq, xs = cuda.quantize_act(x)
    xw, xws = cuda.quantize_act(x, None, True)
    assert torch.equal(xw, ref.to_wgmma_act_order(xq)) and torch.equal(xws, xs)
    natural = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.bfloat16, -1, 0)
    poison(m * n, torch.bfloat16)
    y = torch.ops.mixprec_C.w4a8_gemm(xw, xs, pq, gp, cs, None, torch.bfloat16, -1, 0, True)
    assert torch.equal(y, natural)
    poison(m * n, torch.bfloat16)
    assert torch.equal(cuda.w4a8_linear(x, pq, gp, None, cs), natural)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 64), (3, 576), (200, 4096), (100, 14336), (256, 14336), (5, 28672),
                                 (2, 40960)])
@pytest.mark.parametrize("smooth", [False, True])
def test_quantize_act_wgmma_order(need_wgmma, dtype, m, k, smooth):
    """Every quantizer path (one-pass in registers at 1, 2 and 4 vectors a thread, the two-pass
    loop past 32768 or past 128 rows of K > 8192, the scalar loop for a misaligned x) writes the
    natural codes' wgmma order, and the same scales."""
    gen = _gen(m + k)
    x = torch.randn(m, k, device=DEV, dtype=dtype, generator=gen) * 3
    sm = (torch.rand(k, device=DEV, generator=gen) + 0.5) if smooth else None
    q, s = cuda.quantize_act(x, sm, True)
    qn, sn = cuda.quantize_act(x, sm)
    assert torch.equal(q, ref.to_wgmma_act_order(qn)) and torch.equal(s, sn)
    q_ref, s_ref = ref.quantize_act(x.cpu(), None if sm is None else sm.cpu(), wgmma_order=True)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    odd = torch.randn(m, k + 1, device=DEV, dtype=dtype, generator=gen)[:, 1:]  # rows off 16 B: scalar loop
    qo, so = cuda.quantize_act(odd, sm, True)
    assert torch.equal(qo, ref.to_wgmma_act_order(cuda.quantize_act(odd, sm)[0]))


@pytest.mark.gpu
def test_x_wgmma_order_cuda_graph_of_the_linear(need_wgmma):
    """cuda.w4a8_linear at M = 256 (quantizer in the wgmma order, then the TMA kernel as its
    programmatic dependent) captured and replayed on new inputs: each replay equals eager."""
    m, n, k = 256, 4096, 4096
    gen = _gen(5)
    qw, gs, go, cs = random_lqq(n, k, 128, gen)
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    x_static = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)

    def f(x):
        return cuda.w4a8_linear(x, pq, gp, None, cs)

    graph, y_static, _ = capture_after_warmup(f, x_static)
    for x_new in replays_with_new_inputs(graph, x_static, 55, trials=5):
        xq, xs = cuda.quantize_act(x_new)
        assert torch.equal(y_static, torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.bfloat16, -1, 0))


@pytest.mark.gpu
def test_x_wgmma_order_refused_off_the_wgmma_kernels(need_wgmma):
    pq, gp, cs, xq, xs, gen = _small_layer_at_m16(9)
    assert not cuda.x_wgmma_order_for(16, 256, 512)
    with pytest.raises(RuntimeError, match="x_wgmma_order=True .* decode or mma.sync kernel"):  # auto: decode
        torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, -1, 0, True)
    xq2, xs2 = random_act(300, 512, gen)
    with pytest.raises(RuntimeError, match="x_wgmma_order=True"):  # kernel 3: mma.sync
        torch.ops.mixprec_C.w4a8_gemm(xq2, xs2, pq, gp, cs, None, torch.float16, 3, 0, True)
    with pytest.raises(RuntimeError, match="K = 96 must be a multiple of 64"):
        cuda.quantize_act(torch.randn(4, 96, device=DEV, dtype=torch.float16), None, True)
