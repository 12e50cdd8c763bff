"""Enumerate the Triton variants each FULL decode capture size needs (host-side selectors only)."""
import os, sys
sys.path.insert(0, "/work/main")
from vllm_mixprec.kernels.triton import attention as A
from vllm_mixprec.kernels.triton import residual_directory as RD
from vllm_mixprec.attention_backend import residual as R

SMS, HKV, HQ, D, B, RES = 132, 8, 32, 128, 16, 16
MAX_SEQS = 1024  # vLLM 0.26 default for OPENAI_API_SERVER on >=70 GiB GPUs (arg_utils.py)
sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 513, 16))
assert len(sizes) == 51
cap = A.decode_partials_rows(MAX_SEQS, HKV, SMS)
wb = R.window_blocks(RES, B)
slots = MAX_SEQS * wb + max(16, MAX_SEQS // 4)

def splits(n):  # metadata._splits
    s = A.decode_num_splits(n, HKV, SMS)
    while s > 1 and n * (s + 1) > cap:
        s //= 2
    return s

seen = {"page": set(), "finish": set(), "assign": set()}
rows = []
for i, n in enumerate(sorted(sizes, reverse=True), 1):
    s = splits(n)
    bn, w, st = A.decode_config(D, "kv4", n, HKV, SMS)
    shape = dict(scheme="kv4", head_dim=D, num_kv_heads=HKV, num_sms=SMS)
    merge = A.decode_merge_mode(n, **shape)
    tail = A.decode_tail_mode(n, merge)
    tailv = A.TAIL_MODES[tail]
    partials = s > 1 or tailv != A.TAIL_LAST_SPLIT.value
    fused = partials and merge == "fused"
    finish = partials and not fused
    mx = A.decode_maxnreg(n, merge, **shape).get("maxnreg", 0)
    page = (s, bn, w, st, tail, "fused" if fused else "-", mx, A.kbias_chunk(bn))
    new = []
    if page not in seen["page"]:
        seen["page"].add(page); new.append(f"page(S={s},BN={bn},w{w},st{st},tail={tail},{'fused' if fused else 'kern'},maxnreg={mx or '-'})")
    if finish:
        fk = (s, bn, tail)
        if fk not in seen["finish"]:
            seen["finish"].add(fk); new.append(f"finish(S={s},BN={bn},tail={tail})")
    bw = RD.window_tile(n * wb)
    if bw not in seen["assign"]:
        seen["assign"].add(bw); new.append(f"assign(BLOCK_W={bw},BLOCK_P={1 << (slots - 1).bit_length()})")
    rows.append((i, n, s, f"{bn},{w},{st}", merge, tail, mx, bw, "; ".join(new)))
print(f"part_o cap rows={cap}, window_blocks={wb}, pool slots={slots}")
print("| # | size | splits | cfg | merge | tail | maxnreg | BLOCK_W | new variants |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(str(x) for x in r) + " |")
print({k: len(v) for k, v in seen.items()})
