#!/usr/bin/env python3
"""PyTorch SDPA peer of bench_kernels (run by bench/run_gpu.sh in the same session).

Times torch.nn.functional.scaled_dot_product_attention on the shapes bench_kernels uses (Qwen3-8B heads:
32 query / 8 KV heads, head_dim 128): decode with one query token, enable_gqa=True, contiguous KV
[batch, kv_heads, T, 128]; and causal prefill (is_causal=True). Same method as bench_kernels: random inputs,
several input sets rotated when one set is below 4x L2, warm-up, >= 50 launches each timed with its own CUDA event
pair, median. Each shape is timed with PyTorch's default backend choice and with every backend that accepts it
(flash, efficient, cudnn, math); "best" is the fastest of those.

Usage: sdpa_peer.py --out sdpa_peer.json [--iters N] [--warmup N] [--quick]
"""
import argparse
import datetime
import json
import math
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 32, 8, 128
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def time_it(fn, sets, iters, warmup):
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (a, b) in enumerate(events):
        a.record()
        fn(i % sets)
        b.record()
    torch.cuda.synchronize()
    us = sorted(1000.0 * a.elapsed_time(b) for a, b in events)
    return {"median_us": us[len(us) // 2], "p10_us": us[len(us) // 10], "p90_us": us[(len(us) * 9) // 10],
            "min_us": us[0], "iters": iters}


def rotation_sets(bytes_per_set, l2_bytes):
    return int(min(8, max(1, math.ceil(4 * l2_bytes / max(bytes_per_set, 1)))))


def time_backends(call, sets, args):
    """Default dispatch plus each backend that runs the shape; returns (default, {backend: timing or error})."""
    out = {"default": time_it(call, sets, args.iters, args.warmup)}
    for name, be in BACKENDS.items():
        try:
            with sdpa_kernel([be]):
                call(0)
                torch.cuda.synchronize()
                out[name] = time_it(call, sets, args.iters, args.warmup)
        except Exception as e:  # backend rejects this shape / dtype / GQA
            out[name] = {"error": str(e).splitlines()[0][:200]}
    timed = {k: v for k, v in out.items() if "median_us" in v}
    best = min(timed, key=lambda k: timed[k]["median_us"])
    return out, best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sdpa_peer.json")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    args.iters = max(50, args.iters)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)

    results = []
    # Copy bandwidth of this process (read + write bytes).
    a = torch.randn(1 << 29, device=dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = time_it(lambda s: b.copy_(a), 1, args.iters, args.warmup)
    copy_bytes = 2.0 * a.numel() * 2
    copy_gbps = copy_bytes / (t["median_us"] * 1e3)
    results.append(dict(t, name="torch_copy_1GiB", kind="copy", bytes=copy_bytes, gb_per_s=copy_gbps))
    del a, b
    print(f"torch copy: {copy_gbps:.1f} GB/s", flush=True)

    decode_shapes = [(8, 2048), (8, 2112), (8, 8192), (8, 32768)]
    if not args.quick:
        decode_shapes += [(1, 32768), (32, 4096), (8, 131072)]
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        shapes = decode_shapes if dtype is torch.bfloat16 else [(8, 32768)]
        for batch, T in shapes:
            kv_bytes = 2.0 * batch * HKV * T * D * 2
            sets = rotation_sets(kv_bytes, l2)
            qs = [torch.randn(batch, HQ, 1, D, device=dev, dtype=dtype) for _ in range(sets)]
            ks = [torch.randn(batch, HKV, T, D, device=dev, dtype=dtype) for _ in range(sets)]
            vs = [torch.randn(batch, HKV, T, D, device=dev, dtype=dtype) for _ in range(sets)]

            def call(s):
                return F.scaled_dot_product_attention(qs[s], ks[s], vs[s], enable_gqa=True)

            timings, best = time_backends(call, sets, args)
            bytes_ = kv_bytes + 2.0 * batch * HQ * D * 2
            r = dict(timings["default"], name=f"sdpa_decode_{dtype_name}_B{batch}_T{T}", kind="sdpa_decode",
                     dtype=dtype_name, shape={"batch": batch, "seq_len": T, "num_q_heads": HQ, "num_kv_heads": HKV,
                                              "head_dim": D},
                     bytes=bytes_, input_sets=sets, backends=timings, best_backend=best,
                     best_median_us=timings[best]["median_us"])
            r["gb_per_s"] = bytes_ / (r["median_us"] * 1e3)
            r["ratio_to_copy"] = r["gb_per_s"] / copy_gbps
            results.append(r)
            print(f"{r['name']:<40} default {r['median_us']:9.1f} us {r['gb_per_s']:8.1f} GB/s; best {best} "
                  f"{r['best_median_us']:9.1f} us", flush=True)
            del qs, ks, vs
            torch.cuda.empty_cache()

    prefill = [2048] if args.quick else [2048, 8192]
    for T in prefill:
        q = torch.randn(1, HQ, T, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, HKV, T, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, HKV, T, D, device=dev, dtype=torch.bfloat16)

        def callp(s):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        timings, best = time_backends(callp, 1, args)
        flops = 4.0 * HQ * D * (T * (T + 1) / 2.0)
        r = dict(timings["default"], name=f"sdpa_prefill_bf16_B1_T{T}", kind="sdpa_prefill", dtype="bf16",
                 shape={"batch": 1, "q_len": T, "seq_len": T, "num_q_heads": HQ, "num_kv_heads": HKV, "head_dim": D},
                 flops=flops, backends=timings, best_backend=best, best_median_us=timings[best]["median_us"])
        r["tflop_per_s"] = flops / (r["median_us"] * 1e6)
        results.append(r)
        print(f"{r['name']:<40} default {r['median_us']:9.1f} us {r['tflop_per_s']:6.1f} TFLOP/s; best {best} "
              f"{r['best_median_us']:9.1f} us", flush=True)

    doc = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": os.environ.get("SPADE_COMMIT") or "unknown",
        "copy_gb_per_s": copy_gbps,
        "iters": args.iters,
        "warmup": args.warmup,
        "timing": "median of per-launch CUDA event pairs after warm-up; inputs rotated over sets >= 4x L2",
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
