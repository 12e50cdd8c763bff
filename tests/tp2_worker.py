"""One rank of the CPU tensor-parallel test (tests/quant_methods/test_linear_tp.py).

Run as `python tp2_worker.py RANK WORLD INIT_FILE OUT_FILE`: joins vLLM's TP group over gloo,
builds vLLM's real merged and row-parallel layers with the mixprec method, loads the WHOLE
checkpoint tensors of `make_case()` through their weight loaders (which must cut this rank's
shard: q/k/v heads, gate/up halves, K slices of down_proj, and the matching group parameters),
and saves what the rank computes on the shared input. The test reassembles the ranks' outputs
and compares them with the unsharded reference. `make_case` is imported by the test too, so the
tensors are drawn once, in one place.
"""
from __future__ import annotations

import os
import sys

import torch
from linear_helpers import load_tensors

GROUP = 64
HIDDEN, HEAD, HEADS = 256, 64, 4
INTER = 384  # 192 per rank at TP=2: 3 groups of 64


def make_case(kv_heads: int) -> dict:
    """Full (unsharded) checkpoint tensors and inputs of one decoder layer's linears."""
    from vllm_mixprec import reference as ref

    g = torch.Generator().manual_seed(1234 + kv_heads)

    def lqq(n, k):
        return ref.quantize_weight_lqq(torch.randn(n, k, generator=g), GROUP)

    case = {
        "qkv": {"q": lqq(HEADS * HEAD, HIDDEN), "k": lqq(kv_heads * HEAD, HIDDEN),
                "v": lqq(kv_heads * HEAD, HIDDEN)},
        "gate_up": [lqq(INTER, HIDDEN), lqq(INTER, HIDDEN)],
        "down": lqq(HIDDEN, INTER),
        "x": torch.randn(3, HIDDEN, generator=g).half(),
        "x_down": torch.randn(3, INTER, generator=g).half(),
    }
    case["down_bias"] = torch.randn(HIDDEN, generator=g).half()
    case["qkv_bias"] = {sid: torch.randn(n * HEAD, generator=g).half()
                        for sid, n in (("q", HEADS), ("k", kv_heads), ("v", kv_heads))}
    return case


def run_rank(rank: int, world: int, init_file: str, out_file: str) -> None:
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear)

    from vllm_mixprec import kernels
    from vllm_mixprec.quant_methods import k_bias
    from vllm_mixprec.quant_methods.config import MixPrecConfig

    base = {"quant_method": "mixprec", "format_version": 1, "weight_scheme": "w4a8", "weight_bits": 4,
            "act_bits": 8, "group_size": GROUP, "kv_scheme": "none"}
    out = {}
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     distributed_init_method=f"file://{init_file}", backend="gloo")
        initialize_model_parallel(world, 1)
        cfg = MixPrecConfig.from_config(base)
        for kv_heads in (2, 1):  # 1 KV head at TP=2: vLLM replicates it on both ranks
            case = make_case(kv_heads)
            qkv = QKVParallelLinear(HIDDEN, HEAD, HEADS, kv_heads, bias=True, quant_config=cfg,
                                    params_dtype=torch.float16, prefix="model.layers.0.self_attn.qkv_proj")
            for sid in ("v", "q", "k"):
                load_tensors(qkv, case["qkv"][sid], sid)
                qkv.bias.weight_loader(qkv.bias, case["qkv_bias"][sid], sid)
            qkv.quant_method.process_weights_after_loading(qkv)
            out[f"qkv_kv{kv_heads}"] = qkv.quant_method.apply(qkv, case["x"])  # no bias added
            # what bias-aware K quantization gets: this rank's kv heads of k_proj's bias
            out[f"k_bias_kv{kv_heads}"] = k_bias._qkv_k_bias.pop("model.layers.0.self_attn")

            gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False, quant_config=cfg,
                                                 params_dtype=torch.float16, prefix="model.layers.0.mlp.gate_up_proj")
            load_tensors(gate_up, case["gate_up"][1], 1)
            load_tensors(gate_up, case["gate_up"][0], 0)
            gate_up.quant_method.process_weights_after_loading(gate_up)
            out[f"gate_up_kv{kv_heads}"] = gate_up.quant_method.apply(gate_up, case["x"])

            down = RowParallelLinear(INTER, HIDDEN, bias=False, quant_config=cfg, params_dtype=torch.float16,
                                     prefix="model.layers.0.mlp.down_proj")
            load_tensors(down, case["down"], None)
            down.quant_method.process_weights_after_loading(down)
            part = INTER // world
            # the rank's partial sum; vLLM's all-reduce adds them (the test adds them here)
            out[f"down_kv{kv_heads}"] = down.quant_method.apply(down, case["x_down"][:, rank * part:(rank + 1) * part])
            out[f"shapes_kv{kv_heads}"] = {n: tuple(getattr(qkv, n).shape) for n in qkv.mixprec_params}
            if kv_heads == 2:  # MIXPREC_TP_ACT_SCALE=global: the row maxima all-gathered first
                os.environ["MIXPREC_TP_ACT_SCALE"] = "global"
                down_g = RowParallelLinear(INTER, HIDDEN, bias=False, quant_config=cfg,
                                           params_dtype=torch.float16, prefix="model.layers.0.mlp.down_proj")
                load_tensors(down_g, case["down"], None)
                down_g.quant_method.process_weights_after_loading(down_g)
                del os.environ["MIXPREC_TP_ACT_SCALE"]
                x_r = case["x_down"][:, rank * part:(rank + 1) * part].clone()
                out["down_global"] = down_g.quant_method.apply(down_g, x_r)
                out["act_global"] = kernels.quantize_act_tp(x_r, None)
                if rank == 0:  # a NaN on rank 0's slice: the whole row NaN, on every rank
                    x_r[1, 0] = float("nan")
                out["act_global_nan"] = kernels.quantize_act_tp(x_r, None)
                # vLLM's forward, all-reduce included: its own (16-bit partials), then ours
                # (MIXPREC_TP_REDUCE=exact: integer dot products reduced inside apply), with a bias
                x_r = case["x_down"][:, rank * part:(rank + 1) * part]
                out["down_global_model"] = down_g(x_r)[0]
                os.environ["MIXPREC_TP_REDUCE"] = "exact"
                for bias in (False, True):
                    down_e = RowParallelLinear(INTER, HIDDEN, bias=bias, quant_config=cfg,
                                               params_dtype=torch.float16, prefix="model.layers.0.mlp.down_proj")
                    load_tensors(down_e, case["down"], None)
                    if bias:
                        down_e.bias.weight_loader(down_e.bias, case["down_bias"])
                    down_e.quant_method.process_weights_after_loading(down_e)
                    out[f"down_exact_flags_{bias}"] = (down_e.reduce_results, down_e.mixprec_reduce_exact)
                    out[f"down_exact_{bias}"] = down_e(x_r)[0]
                del os.environ["MIXPREC_TP_REDUCE"]

        for what, kwargs in (("w4ax_row", dict(weight_scheme="w4ax", act_bits="4/8", a8_fraction=0.25)),
                             ("g128_row", dict(group_size=128))):
            try:
                RowParallelLinear(INTER if what == "g128_row" else 512, HIDDEN, bias=False,
                                  quant_config=MixPrecConfig.from_config(dict(base, **kwargs)),
                                  params_dtype=torch.float16, prefix="model.layers.0.mlp.down_proj")
                out[what] = "no error"
            except ValueError as e:
                out[what] = str(e)
    torch.save(out, out_file)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
