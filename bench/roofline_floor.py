"""A roofline estimate of the thesis's setup: a 1B generator and an 8B PRM in bf16 on one H100.

    python bench/roofline_floor.py [--gpu h100-sxm|h100-pcie|h200]
    python bench/roofline_floor.py --prm-72b-tp 4      (a 72B PRM split over 4 GPUs: its all-reduces)

Computed, not measured: bytes and FLOPs per generator decode step and per PRM scoring step
at the batch sizes beam search produces, the time floor of each (max of bytes / bandwidth
and FLOPs / peak) and which bound applies, then the floor of a whole beam search per
problem with many problems in flight (weights read once per step for all of them).

Shapes: the generator is Llama 3.2 1B (16 layers, hidden 2048, 32 q / 8 KV heads of 64,
MLP 8192, vocab 128256, tied embeddings); the PRM is Llama 3.1 8B (32 layers, hidden 4096,
32 / 8 heads of 128, MLP 14336, vocab 128256; it reads two logits per step tag, so its LM
head is negligible). Datasheet numbers: H100 SXM 3.35 TB/s and 989 TFLOP/s dense bf16,
H100 PCIe 2.0 TB/s and 756, H200 4.8 TB/s and 989.

`--prm-72b-tp K`: a Qwen2.5-Math-PRM-72B-shaped PRM (80 layers, hidden 8192, 64 / 8 heads of
128, MLP 29568, vocab 152064; a reward head: hidden states, no logits) tensor-parallel over K
GPUs: per scoring step, each GPU's share of the floor above, and the two all-reduces per layer
(after o_proj and down_proj, [tokens, hidden] bf16 each, as models/sharding.py makes them): a
ring moves 2 (K-1)/K of each message through every GPU, at NVLink 4's 450 GB/s a direction,
plus a fixed ~10 us an all-reduce (small-message latency, an assumption, not a measurement).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GPUS = {"h100-sxm": (3.35e12, 989e12), "h100-pcie": (2.0e12, 756e12), "h200": (4.8e12, 989e12)}
BF16 = 2


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int

    @property
    def body_params(self) -> int:
        """Parameters of the transformer layers (every token multiplies by all of them)."""
        attn = self.hidden * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.mlp)

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * BF16

    def attention_flops(self, queries: int, keys: int) -> float:
        """q.k and p.v over `keys` keys for `queries` queries, every layer and head."""
        return 4.0 * queries * keys * self.layers * self.q_heads * self.head_dim


GENERATOR = Shape("generator 1B", 16, 2048, 32, 8, 64, 8192, 128256)
PRM = Shape("PRM 8B", 32, 4096, 32, 8, 128, 14336, 128256)
PRM_72B = Shape("PRM 72B", 80, 8192, 64, 8, 128, 29568, 152064)
NVLINK_BYTES_PER_S = 450e9  # NVLink 4 (H100 SXM), one direction
ALL_REDUCE_LATENCY_S = 10e-6


def floor(nbytes: float, flops: float, gpu: tuple[float, float]) -> tuple[float, str]:
    bandwidth, peak = gpu
    t_bytes, t_flops = nbytes / bandwidth, flops / peak
    return max(t_bytes, t_flops), "memory" if t_bytes >= t_flops else "compute"


def decode_step(n: int, context: int) -> tuple[float, float]:
    """One generator step: n sequences, one token each, `context` keys each."""
    g = GENERATOR
    nbytes = (g.body_params + g.head_params) * BF16 + n * context * g.kv_bytes_per_token
    flops = 2.0 * (g.body_params + g.head_params) * n + g.attention_flops(n, context)
    return nbytes, flops


def prm_step(n: int, context: int, step: int) -> tuple[float, float]:
    """One PRM scoring step: n beams each prefill `step` new tokens after `context` cached ones."""
    p = PRM
    nbytes = p.body_params * BF16 + n * (context + step) * p.kv_bytes_per_token
    flops = 2.0 * p.body_params * n * step + p.attention_flops(n * step, context + step // 2)
    return nbytes, flops


def search_floor(n: int, prompt: int, iterations: int, step: int, gpu: tuple[float, float]) -> dict:
    """Beam search with many problems in flight: weights amortised, KV and FLOPs per problem."""
    generated = n * iterations * step
    mean_context = prompt + iterations * step / 2
    gen_bytes = generated * mean_context * GENERATOR.kv_bytes_per_token
    gen_flops = 2.0 * (GENERATOR.body_params + GENERATOR.head_params) * generated
    gen_flops += GENERATOR.attention_flops(generated, int(mean_context))
    prm_bytes = generated * mean_context * PRM.kv_bytes_per_token / step  # each new step reads its prefix once
    prm_flops = 2.0 * PRM.body_params * generated + PRM.attention_flops(generated, int(mean_context))
    gen_t, gen_bound = floor(gen_bytes, gen_flops, gpu)
    prm_t, prm_bound = floor(prm_bytes, prm_flops, gpu)
    return {
        "gen_s": gen_t,
        "gen_bound": gen_bound,
        "prm_s": prm_t,
        "prm_bound": prm_bound,
        "problems_per_min": 60.0 / (gen_t + prm_t),
    }


def tp_prm_step(n: int, context: int, step: int, k: int, gpu: tuple[float, float]) -> dict:
    """One scoring step of the 72B PRM over k GPUs: each GPU's compute floor and its all-reduces."""
    p = PRM_72B
    nbytes = (p.body_params * BF16 + n * (context + step) * p.kv_bytes_per_token) / k
    flops = (2.0 * p.body_params * n * step + p.attention_flops(n * step, context + step // 2)) / k
    compute, bound = floor(nbytes, flops, gpu)
    message = n * step * p.hidden * BF16  # one all-reduce's [tokens, hidden] bf16
    count = 2 * p.layers
    comm = count * (2 * (k - 1) / k * message / NVLINK_BYTES_PER_S + ALL_REDUCE_LATENCY_S)
    return {
        "compute_s": compute,
        "bound": bound,
        "message_bytes": message,
        "all_reduces": count,
        "ring_bytes_per_gpu": count * 2 * (k - 1) / k * message,
        "comm_s": comm,
        "comm_share": comm / (compute + comm),
    }


def tp_table(k: int, gpu: tuple[float, float]) -> None:
    print(f"PRM 72B at tensor_parallel_size={k}, scoring 100 new tokens a beam after 1024 cached:\n")
    print(
        "| N | tokens | compute floor per GPU (ms) | all-reduces | MB each | GB through each GPU | "
        "all-reduce time (ms) | share of the step (not overlapped) |\n|---|---|---|---|---|---|---|---|"
    )
    for n in (4, 16, 64, 256):
        e = tp_prm_step(n, 1024, 100, k, gpu)
        print(
            f"| {n} | {n * 100} | {e['compute_s'] * 1e3:.1f} ({e['bound']}) | {e['all_reduces']} | "
            f"{e['message_bytes'] / 1e6:.2f} | {e['ring_bytes_per_gpu'] / 1e9:.2f} | {e['comm_s'] * 1e3:.1f} | "
            f"{e['comm_share']:.0%} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="h100-sxm", choices=sorted(GPUS))
    parser.add_argument("--prm-72b-tp", type=int, default=None, metavar="K")
    args = parser.parse_args()
    gpu = GPUS[args.gpu]
    if args.prm_72b_tp:
        return tp_table(args.prm_72b_tp, gpu)
    print(f"{args.gpu}: {gpu[0] / 1e12:.2f} TB/s, {gpu[1] / 1e12:.0f} TFLOP/s bf16\n")
    print("| step | N | context | GB read | GFLOP | floor (ms) | bound |\n|---|---|---|---|---|---|---|")
    for n in (4, 16, 64, 256):
        for context in (256, 2048):
            nbytes, flops = decode_step(n, context)
            t, bound = floor(nbytes, flops, gpu)
            print(
                f"| generator decode | {n} | {context} | {nbytes / 1e9:.2f} | {flops / 1e9:.0f} | "
                f"{t * 1e3:.3f} | {bound} |"
            )
    for n in (4, 16, 64, 256):
        nbytes, flops = prm_step(n, 1024, 100)
        t, bound = floor(nbytes, flops, gpu)
        print(
            f"| PRM score, 100 new tokens/beam | {n} | 1024 | {nbytes / 1e9:.2f} | {flops / 1e9:.0f} | "
            f"{t * 1e3:.2f} | {bound} |"
        )
    print("\nBeam search per problem, many problems in flight (prompt 200 tokens, 10 iterations of 100-token steps):\n")
    print("| N | generator floor (s) | PRM floor (s) | problems/min at the floor |\n|---|---|---|---|")
    for n in (16, 64):
        f = search_floor(n, prompt=200, iterations=10, step=100, gpu=gpu)
        print(
            f"| {n} | {f['gen_s']:.3f} ({f['gen_bound']}) | {f['prm_s']:.3f} ({f['prm_bound']}) | "
            f"{f['problems_per_min']:.0f} |"
        )


if __name__ == "__main__":
    main()
