"""Operators per decode step before and after the fused Triton chains (issue 53, "fewer launches").

    TRITON_INTERPRET=1 python bench/fused_ops.py [--archs llama,gemma3_text] [--seqs 4]
    python bench/fused_ops.py --device cuda        # on a GPU: also counts the kernels it ran

Runs one decode step of `--seqs` sequences on a tiny random checkpoint of each architecture
(tests/tiny_models.py: 2 layers, bf16 by default, needs transformers to build) on the `triton`
attention backend, twice: `plain` (the forward a GPU runs without the fused chains) and
`fused` (the choices `pick_kernel` makes on CUDA: residual adds inside the norms, every norm
one launch, rope inside the KV store, act(gate) * up one launch; on a CPU they are set by
hand, as tests/kernels/test_triton_fused.py does, and run in Triton's interpreter).

What is counted, inside the model's forward (embedding, decoder layers, final norm; not the
LM head or the sampler): every aten operator as the model calls it (a TorchDispatchMode under
the runner's inference mode, which sees composites such as `rms_norm` and `linear` whole, as
recent PyTorch runs each as one CUDA kernel; a CPU splits them), except views (and `to` or
`contiguous` where they return their input) and allocations (`empty*`), which launch nothing;
plus each Triton kernel launch as one (the interpreter's own tensor work is not counted). On
a CPU the model is set up as CUDA sets it up (`as_on_cuda`: F.linear on weights of the model's
dtype for every matmul, no C kernels). Each counted item is about one CUDA launch: an op may
launch more (a split-K matmul) or none, so this is the operator count the issue asks for on a
CPU, not a measurement of launches. It depends on the architecture, the dtype (bf16 norms cast
to fp32 and back) and the number of layers, not on the model's sizes or the batch.
`--device cuda` adds the torch profiler's count of device activities (kernels, memcpy, memset)
for the same step: the launches themselves.

Measured here (bf16, 2 layers, per decoder layer): Llama 33 -> 12, Gemma 3 45 -> 16; per
forward 6 + 33 L -> 4 + 12 L and 8 + 45 L -> 7 + 16 L (Llama 3.2 1B, L = 16: ~534 -> ~196;
Gemma 3 270M, L = 18: ~818 -> ~295).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.tiny_models import build_checkpoint  # noqa: E402
from treeserve import LLM, SamplingParams  # noqa: E402
from treeserve.layers.linear import Linear  # noqa: E402

GEMMA = {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}


class OpCounter(TorchDispatchMode):
    """aten operators that launch work, by scope ("layers" inside a decoder layer, else "model")."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, str]] = Counter()
        self.scope = "model"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not name.startswith("empty") and not (func.is_view and _aliases(out, args[0])):
            self.ops[self.scope, f"aten.{name}"] += 1  # a may-alias op (`to`, `contiguous`) counts when it copied
        return out

    def launch(self, kernel: str) -> None:
        self.ops[self.scope, f"triton.{kernel}"] += 1


def _aliases(out: object, source: object) -> bool:
    first = out[0] if isinstance(out, tuple | list) else out
    if not (isinstance(first, torch.Tensor) and isinstance(source, torch.Tensor)):
        return True
    return first.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


def count_triton_launches(counter: list[OpCounter | None]) -> None:
    """Each Triton kernel launch counted once by the active counter, its own tensor work not at all."""
    import triton.runtime.interpreter as interpreter
    from triton.runtime.jit import JITFunction

    for cls in (interpreter.InterpretedFunction, JITFunction):
        inner = cls.run

        def run(self, *args, _inner: Callable = inner, **kwargs):  # noqa: ANN001, ANN202 - triton's signature
            if counter[0] is None:
                return _inner(self, *args, **kwargs)
            counter[0].launch(self.fn.__name__)
            with _disable_current_modes():
                return _inner(self, *args, **kwargs)

        cls.run = run


def as_on_cuda(model: torch.nn.Module, dtype: torch.dtype, fused: bool) -> None:
    """The kernel choices `pick_kernel` makes on CUDA, made by hand on a CPU: F.linear on weights
    of the model's dtype for every matmul (no CPU row padding or widening), no C kernels, and
    the fused chains or not."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.kernel = F.linear
            module.weight = torch.nn.Parameter(module.weight.to(dtype), requires_grad=False)
            if module.bias is not None:
                module.bias = torch.nn.Parameter(module.bias.to(dtype), requires_grad=False)
        if hasattr(module, "use_c"):
            module.use_c = False
        if hasattr(module, "use_triton"):
            module.use_triton = fused
    for rope in model.rope_tables():
        rope.use_c, rope.use_triton = False, fused
    model.layer_stack = None


def count_decode_step(llm: LLM, seqs: int, counter_slot: list[OpCounter | None], profile: bool) -> dict:
    """Counts of the model's forward in the last decode step (`seqs` rows) of a short generation."""
    model = llm.engine.model
    calls: list[tuple[int, OpCounter, int | None]] = []
    forward = model.forward

    def counted_forward(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        counter = OpCounter()
        counter_slot[0] = counter
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if profile else None
        try:
            if profiler is not None:
                profiler.start()
            with counter:
                out = forward(input_ids, *args)
            device_events = None
            if profiler is not None:
                torch.cuda.synchronize()
                profiler.stop()
                device_events = sum(1 for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        finally:
            counter_slot[0] = None
        calls.append((input_ids.shape[0], counter, device_events))
        return out

    for layer in model.layers:
        for name in ("forward", "forward_fused"):
            inner = getattr(layer, name)

            def scoped(*args: object, _inner: Callable = inner) -> object:
                counter = counter_slot[0]
                if counter is None:
                    return _inner(*args)
                counter.scope = "layers"
                try:
                    return _inner(*args)
                finally:
                    counter.scope = "model"

            setattr(layer, name, scoped)
    model.forward = counted_forward
    prompts = [[5 + i, 9, 14, 3 + i, 7, 11] for i in range(seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _, counter, device_events = [c for c in calls if c[0] == seqs][-1]
    layers = len(model.layers)
    per_layer = Counter({op: n / layers for (scope, op), n in counter.ops.items() if scope == "layers"})
    outside = sum(n for (scope, _), n in counter.ops.items() if scope == "model")
    return {"total": sum(counter.ops.values()), "per_layer": per_layer, "outside": outside, "device": device_events}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default="llama,gemma3_text")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype: bfloat16 (a GPU's) or float32")
    args = ap.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1: on a CPU the Triton kernels run in the interpreter")
    counter_slot: list[OpCounter | None] = [None]
    count_triton_launches(counter_slot)
    rows = []
    for arch in args.archs.split(","):
        path = build_checkpoint(
            os.path.join(tempfile.gettempdir(), f"treeserve-fused-ops-{arch}"),
            arch,
            **(GEMMA if arch == "gemma3_text" else {}),
        )
        results = {}
        for variant in ("plain", "fused"):
            llm = LLM(
                path,
                dtype=args.dtype,
                device=args.device,
                attention_backend="triton",
                page_size=4,
                kv_cache_memory=1 << 20,
                enforce_eager=True,
            )
            if args.device == "cpu":
                as_on_cuda(llm.engine.model, getattr(torch, args.dtype), fused=variant == "fused")
            elif variant == "plain":  # pick_kernel chose the fused chains on CUDA
                for module in [*llm.engine.model.modules(), *llm.engine.model.rope_tables()]:
                    if hasattr(module, "use_triton"):
                        module.use_triton = False
            results[variant] = count_decode_step(llm, args.seqs, counter_slot, args.device == "cuda")
        rows.append((arch, len(llm.engine.model.layers), results))

    print(
        f"one decode step of {args.seqs} sequences, the model's forward ({args.device}, {args.dtype}, "
        f"torch {torch.__version__})"
    )
    print("| arch | path | ops in the forward | per decoder layer | outside the layers | device activities |")
    print("|---|---|---|---|---|---|")
    for arch, _, results in rows:
        for variant, r in results.items():
            per_layer = sum(r["per_layer"].values())
            print(f"| {arch} | {variant} | {r['total']} | {per_layer:g} | {r['outside']} | {r['device'] or '-'} |")
    for arch, _, results in rows:
        print(f"\n{arch}: operators per decoder layer (plain -> fused)")
        plain, fused = results["plain"]["per_layer"], results["fused"]["per_layer"]
        for op in sorted(set(plain) | set(fused), key=lambda o: (-plain.get(o, 0), o)):
            print(f"  {op:40s} {plain.get(op, 0):4g} -> {fused.get(op, 0):g}")


if __name__ == "__main__":
    main()
