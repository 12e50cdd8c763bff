"""Exhaustive LiquidQuant lane checks: every group (min, max) pair in [-119, 119], both
step candidates, every reachable code."""
import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref

LO, HI = -F.W8_PROTECT, F.W8_PROTECT


def all_pairs():
    mn, mx = torch.meshgrid(torch.arange(LO, HI + 1), torch.arange(LO, HI + 1), indexing="ij")
    keep = mn <= mx
    return mn[keep], mx[keep]


def test_every_reachable_lane_value_fits_a_byte_and_packed_word_matches():
    mn, mx = all_pairs()
    assert mn.numel() == 239 * 240 // 2
    rng = (mx - mn).double()
    checked = 0
    for step in (torch.floor(rng / 15).clamp(1, 16), torch.ceil(rng / 15).clamp(1, 16)):
        step = step.long()
        # codes reachable by rounding any value in [mn, mx]: 0 .. min(15, round(range/step))
        qmax = torch.round(rng / step).clamp(max=15).long()
        offset = 128 + mn
        q = torch.arange(16)[None, :]
        lane = q * step[:, None] + offset[:, None]
        reachable = q <= qmax[:, None]
        assert int(lane[reachable].max()) <= 255 and int(lane[reachable].min()) >= 0
        # decoded int8 values are exactly min + q*step, and stay inside [mn - 0, mx + step/2]
        val = ref.F.lqq_dequant_lanes(q.expand_as(lane), step[:, None], offset[:, None]).long()
        assert torch.equal(val[reachable], (mn[:, None] + q * step[:, None]).expand_as(lane)[reachable])
        # the 32-bit 4-lane register recipe, for every reachable code in each lane
        for s, a, qm, lo in zip(step.tolist(), offset.tolist(), qmax.tolist(), mn.tolist()):
            codes = list(range(qm + 1))
            for j in range(0, len(codes), 4):
                lanes = (codes[j:j + 4] + [qm, 0, qm])[:4]  # pad with the extremes
                word = sum(c << (8 * i) for i, c in enumerate(lanes))
                out = F.lqq_dequant_packed_word(word, s, a)
                got = [((out >> (8 * i)) & 0xFF) for i in range(4)]
                want = [(lo + c * s) & 0xFF for c in lanes]
                assert got == want, (lo, s, lanes)
                checked += 1
    assert checked > 100_000


def test_group_params_and_encode_never_leave_the_reachable_set():
    # one group per (min, max) pair: min, max and 62 values spread between them
    mn, mx = all_pairs()
    t = torch.linspace(0, 1, 62, dtype=torch.float64)[None, :]
    mid = torch.round(mn[:, None] + t * (mx - mn)[:, None])
    g = torch.cat([mn[:, None].double(), mx[:, None].double(), mid], dim=1).to(torch.int8)
    for cands in (1, 2):
        step, offset = ref.lqq_group_params(g, 64, step_candidates=cands)
        assert int(step.min()) >= 1 and int(step.max()) <= F.MAX_GROUP_STEP
        assert int(offset.min()) >= 128 - F.W8_PROTECT and int(offset.max()) <= 128 + F.W8_PROTECT
        q = ref.lqq_encode(g, step, offset, 64)
        assert int(q.max()) <= 15
        lane = q.long() * step.long() + offset.long()
        assert int(lane.max()) <= 255
        # decoding the packed codes: half a step of rounding error, or the clamped top of the
        # range when the floor step was chosen (its trade-off, picked by squared error)
        w8 = ref.dequantize_weight_w8(F.pack_nibbles(q), step, offset).long()
        err = (w8 - g.long()).abs()
        st = step.long()
        clamped = (mx - mn)[:, None] - 15 * st
        assert bool((2 * err <= torch.maximum(st, 2 * clamped)).all())
        if cands == 1:  # ceil step alone: plain rounding
            assert bool((2 * err <= st).all())


def test_group_params_and_codes_match_a_float64_oracle():
    """lqq_group_params / lqq_encode compute in float32 for speed; for every (min, max) pair
    (values spread between them, both ends included) they equal this float64 oracle."""
    mn, mx = all_pairs()
    g = (mn[:, None] + (mx - mn)[:, None] * torch.linspace(0, 1, 64)).round().double()
    rng = (mx - mn).double()
    oracle_step, oracle_err = None, None
    for step in (torch.ceil(rng / 15).clamp(1, 16), torch.floor(rng / 15).clamp(1, 16)):
        q = torch.round((g - mn[:, None]) / step[:, None]).clamp(0, 15)
        err = ((q * step[:, None] + mn[:, None] - g) ** 2).sum(-1)
        if oracle_step is None:
            oracle_step, oracle_err = step, err
        else:
            oracle_step = torch.where(err < oracle_err, step, oracle_step)
    w8 = g.to(torch.int8)
    step, offset = ref.lqq_group_params(w8, 64)
    assert torch.equal(step.flatten().double(), oracle_step)
    assert torch.equal(offset.flatten().long(), 128 + mn)
    codes = torch.round((g - mn[:, None]) / oracle_step[:, None]).clamp(0, 15)
    assert torch.equal(ref.lqq_encode(w8, step, offset, 64).double(), codes)
