"""Compile every Triton kernel for a Hopper GPU (sm_90) to cubin, with no GPU present.

Run as a script with TRITON_INTERPRET unset (`test_triton_compile.py` does): the
interpreter accepts programs a GPU compile refuses (loop-carried types that change, shapes
tl.dot cannot take), so this catches what the interpreter tests cannot. Prints one line
per kernel configuration and exits 1 if any failed to compile.
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from treeserve.kernels.triton import decode_attention, kv_store, prefill_attention, sampling

HOPPER = GPUTarget("cuda", 90, 32)
ARENA = dict(tables_ptr="*i64", tables_stride=8, cache_stride_page=99968, cache_stride_slot=256, cache_stride_h=64)


def compiles(kernel: triton.JITFunction, args: dict, label: str) -> bool:
    signature, constants = {}, {}
    for param in kernel.params:
        value = args[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, str):
            signature[param.name] = value
        else:
            signature[param.name] = "fp32" if isinstance(value, float) else "i32"
    try:
        triton.compile(ASTSource(kernel, signature, constants), target=HOPPER)
    except Exception as e:  # noqa: BLE001 - report every failure, then exit 1
        print(f"FAIL {label}: {type(e).__name__}: {str(e)[:1500]}")
        return False
    print(f"ok   {label}")
    return True


def main() -> int:
    ok = True
    for dt, kv in (("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "u8")):  # an FP8 cache: e4m3 bytes
        fp8 = kv == "u8"
        cache = dict(k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}", scales_ptr="*fp32", KV_FP8=fp8, **ARENA)
        for window in (0, 7):
            for group, dim, page in ((1, 64, 16), (4, 128, 1), (8, 256, 64), (2, 80, 4)):
                block_d = max(triton.next_power_of_2(dim), 16)
                shape = f"{dt} kv={kv} window={window} group={group} D={dim} page={page}"
                ok &= compiles(
                    decode_attention._partial,
                    dict(
                        q_ptr=f"*{dt}",
                        lens_ptr="*i64",
                        max_ptr="*fp32",
                        sum_ptr="*fp32",
                        acc_ptr="*fp32",
                        **cache,
                        q_stride_b=512,
                        q_stride_h=64,
                        scale=0.125,
                        window=window,
                        num_splits=3,
                        parts=32,
                        min_length=1024,
                        GROUP=group,
                        D=dim,
                        BLOCK_G=max(triton.next_power_of_2(group), 16),
                        BLOCK_D=block_d,
                        PAGE=page,
                        UPCAST=False,
                        FINAL=False,
                        BLOCK_N=decode_attention.BLOCK_N,
                    ),
                    f"decode {shape}",
                )
                ok &= compiles(
                    prefill_attention._prefill,
                    dict(
                        q_ptr=f"*{dt}",
                        starts_ptr="*i64",
                        lens_ptr="*i64",
                        context_ptr="*i64",
                        out_ptr=f"*{dt}",
                        **cache,
                        q_stride_t=512,
                        q_stride_h=64,
                        scale=0.125,
                        window=window,
                        GROUP=group,
                        D=dim,
                        BLOCK_D=block_d,
                        PAGE=page,
                        BLOCK_M=prefill_attention.BLOCK_M,
                        BLOCK_N=prefill_attention.BLOCK_N,
                        UPCAST=False,
                    ),
                    f"prefill {shape}",
                )
        ok &= compiles(
            decode_attention._reduce,
            dict(
                max_ptr="*fp32",
                sum_ptr="*fp32",
                acc_ptr="*fp32",
                out_ptr=f"*{dt}",
                out_stride_b=512,
                out_stride_h=64,
                num_parts=3,
                D=64,
                BLOCK_P=4,
                BLOCK_D=64,
            ),
            f"decode reduce {dt}",
        )
        ok &= compiles(
            kv_store._store_kv,
            dict(
                k_ptr=f"*{dt}",
                v_ptr=f"*{dt}",
                k_cache_ptr=f"*{kv}",
                v_cache_ptr=f"*{kv}",
                pages_ptr="*i64",
                offsets_ptr="*i64",
                scales_ptr="*fp32",
                k_stride_t=768,
                k_stride_h=64,
                v_stride_t=768,
                v_stride_h=64,
                cache_stride_page=99968,
                cache_stride_slot=256,
                cache_stride_h=64,
                HEADS=4,
                D=64,
                BLOCK_H=4,
                BLOCK_D=64,
                KV_FP8=fp8,
            ),
            f"store {dt} kv={kv}",
        )
        chunks = -(-151936 // sampling.CHUNK)
        ok &= compiles(
            sampling._chunk_stats,
            dict(
                logits_ptr=f"*{dt}",
                stride=151936,
                max_ptr="*fp32",
                sum_ptr="*fp32",
                vocab=151936,
                chunks=chunks,
                CHUNK=sampling.CHUNK,
                BLOCK=sampling.BLOCK,
            ),
            f"sample chunk stats {dt}",
        )
        ok &= compiles(
            sampling._draw_row,
            dict(
                logits_ptr=f"*{dt}",
                stride=151936,
                max_ptr="*fp32",
                sum_ptr="*fp32",
                uniforms_ptr="*fp64",
                out_ptr="*i64",
                vocab=151936,
                chunks=chunks,
                CHUNK=sampling.CHUNK,
                BLOCK=sampling.BLOCK,
                CHUNKS=triton.next_power_of_2(chunks),
            ),
            f"sample draw {dt}",
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
