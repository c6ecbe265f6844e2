"""The model behind the packaged Kimi profiles' verify tables: what one GPU of a TP-8 node spends
on a verifier forward of B sequences with t tokens each, for a Kimi-K2.5-sized verifier
(DeepSeek-V3 layout, INT4 routed experts), from spec-sheet bandwidth and compute. It writes
`verify_ms` (batch 1) and `verify_batch_ms` (the surface) of
eagle3_ray/plan/profiles/{pcie-8x-rtx-pro-6000,nvlink-8x-h100}-kimi-k2.5*.yaml, and checks the
PCIe node against the public Kimi-K2.6 figures (check_public_figures).

Per GPU, a forward of N = B·t tokens:
    bytes(B, t)  = W + B·ctx·kv + L_moe · E(1 − (1 − k/E)^N) · e
                   W: the weights every forward reads once (sharded attention, replicated
                   q_a/kv_a, dense FFN, shared experts, lm_head, routers: 4.542 GB);
                   kv: MLA latent cache bytes per context token, replicated on every GPU
                   (61 layers x 576 x 2 B); the routed experts touched by N tokens with
                   independent top-k routing (E = 384, k = 8), e = one INT4 expert's share
                   (3 x 7168 x 2048 x 4.5 bits / 8 GPUs = 3.10 MB), L_moe = 60 layers
    flops(B, t)  = N · (2 · active / n + 2 · heads · ctx · (576 + 512) · layers / n)
                   the active weights' matmuls and MLA's absorbed attention over ctx
    V(B, t)      = max(bytes / BW_eff, flops / F_eff) + overhead
The weights are read once for all N tokens (memory-bound: extra tokens are nearly free until the
experts saturate and N·flops catches up with the reads); the all-reduces per layer, which grow
with N, are the profile's interconnect (plan/cost.py comm_s), not part of V.

    python -m eagle3_ray.plan.roofline            # the YAML tables and the public-figure check
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Kimi-K2.5's text model (config.json of moonshotai/Kimi-K2.5; profile comments derive each)
LAYERS, MOE_LAYERS, EXPERTS, TOP_K, HEADS = 61, 60, 384, 8, 64
WEIGHTS_GB = 4.542                      # per GPU, read once a forward at any N (TP 8)
EXPERT_MB = 3.096                       # one routed expert's INT4 share per GPU per layer
KV_BYTES_PER_TOKEN = LAYERS * 576 * 2   # MLA latent + rope key, bf16, every GPU holds all
ACTIVE_PARAMS = 32e9                    # per token
GPUS = 8

BATCH_SIZES = (2, 4, 8, 16, 32, 64, 128, 256)
BATCH_TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17)       # tokens per sequence: depths 0..16
BATCH1_TOKENS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 28, 33)


@dataclass
class Node:
    name: str
    mem_gbps: float          # effective memory bandwidth of one GPU (decode kernels)
    tflops: float            # effective bf16 tensor throughput of one GPU on these kernels
    overhead_ms: float = 0.5  # launches and non-bandwidth work per forward (CUDA graphs)


# RTX PRO 6000 Blackwell: 1792 GB/s at 70% = 1254; ~500 TFLOPS dense bf16 peak, 35% achieved on
# W4A16 grouped MoE GEMMs and MLA decode attention (ASSUMED) = 175.
# H100 SXM: 3350 GB/s at 70% = 2345; 989 TFLOPS dense bf16 peak, 35% (ASSUMED) = 346.
PCIE = Node("pcie-8x-rtx-pro-6000", 1254.0, 175.0)
NVLINK = Node("nvlink-8x-h100", 2345.0, 346.0)


def distinct_experts(tokens: int) -> float:
    """Routed experts one MoE layer touches for `tokens` tokens routed independently."""
    return EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** tokens)


def forward_bytes(batch: int, tokens: int, context: int) -> float:
    n = batch * tokens
    return (WEIGHTS_GB * 1e9 + batch * context * KV_BYTES_PER_TOKEN
            + MOE_LAYERS * distinct_experts(n) * EXPERT_MB * 1e6)


def forward_flops(batch: int, tokens: int, context: int) -> float:
    per_token = (2 * ACTIVE_PARAMS + 2 * HEADS * context * (576 + 512) * LAYERS) / GPUS
    return batch * tokens * per_token


def verify_ms(node: Node, batch: int, tokens: int, context: int) -> float:
    """V(B, t) in ms: the roofline of one GPU's share of the forward, plus the overhead."""
    mem = forward_bytes(batch, tokens, context) / (node.mem_gbps * 1e9)
    comp = forward_flops(batch, tokens, context) / (node.tflops * 1e12)
    return (max(mem, comp)) * 1e3 + node.overhead_ms


def tables(node: Node, context1: int = 4096, context: int = 2048) -> dict:
    """{"verify_ms": batch 1 at a `context1`-token context, "verify_batch_ms": the surface at
    `context` tokens of context per sequence (a batch of 128 at 4096 would not fit the KV cache
    of either node)}, 2 decimals."""
    return {"verify_ms": {t: round(verify_ms(node, 1, t, context1), 2) for t in BATCH1_TOKENS},
            "verify_batch_ms": {b: {t: round(verify_ms(node, b, t, context), 2)
                                    for t in BATCH_TOKENS} for b in BATCH_SIZES}}


# Kimi-K2.6, TP 8 on 8x RTX PRO 6000 over PCIe, EAGLE-3 drafter at 3 tokens (issue 59):
# concurrency -> (tok/s with the drafter, without)
PUBLIC = {1: (90.0, 74.0), 128: (1137.0, 1261.0)}
PUBLIC_DEPTH = 3


def check_public_figures(profile=None) -> dict:
    """The PCIe profile against PUBLIC: the acceptance length E[τ](3) that reproduces the
    measured gain at concurrency 1, then the model's tokens/s with and without the drafter at
    each concurrency and the predicted gain against the measured one."""
    from eagle3_ray.plan import load, profiles
    p = profile or profiles.load_profile("pcie-8x-rtx-pro-6000-kimi-k2.5")
    k = PUBLIC_DEPTH
    with1, without1 = PUBLIC[1]
    tau = with1 / without1 * load.round_batch_s(p, 1, k) / load.round_batch_s(p, 1, 0)
    rows = []
    for c, (w, wo) in PUBLIC.items():
        plain = c / load.round_batch_s(p, c, 0)
        spec = c * tau / load.round_batch_s(p, c, k)
        rows.append({"concurrency": c, "model_tok_s": spec, "model_tok_s_depth0": plain,
                     "model_gain": spec / plain, "public_tok_s": w, "public_tok_s_depth0": wo,
                     "public_gain": w / wo})
    return {"profile": p.name, "depth": k, "accept_len_from_concurrency_1": tau, "rows": rows}


def main() -> None:
    import yaml
    for node in (PCIE, NVLINK):
        print(f"# {node.name}: {node.mem_gbps:g} GB/s, {node.tflops:g} TFLOPS effective")
        print(yaml.safe_dump(tables(node), sort_keys=False))
    chk = check_public_figures()
    print(f"# {chk['profile']}: E[tau]({chk['depth']}) = "
          f"{chk['accept_len_from_concurrency_1']:.2f} from the concurrency-1 gain")
    for r in chk["rows"]:
        print(f"#   concurrency {r['concurrency']}: model {r['model_tok_s']:.0f} vs "
              f"{r['model_tok_s_depth0']:.0f} tok/s (x{r['model_gain']:.2f}); public "
              f"{r['public_tok_s']:.0f} vs {r['public_tok_s_depth0']:.0f} "
              f"(x{r['public_gain']:.2f})")
    assert math.isfinite(chk["accept_len_from_concurrency_1"])


if __name__ == "__main__":
    main()
