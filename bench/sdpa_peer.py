#!/usr/bin/env python3
"""PyTorch SDPA peer of bench_kernels (run by bench/run_gpu.sh in the same session).

Times torch.nn.functional.scaled_dot_product_attention on the shapes bench_kernels uses (Qwen3-8B heads:
32 query / 8 KV heads, head_dim 128): decode with one query token, enable_gqa=True, contiguous KV
[batch, kv_heads, T, 128]; and causal prefill (is_causal=True). Same method as bench_kernels: random inputs,
several input sets rotated when one set is below 4x L2, warm-up, >= 50 launches each timed with its own CUDA event
pair, median. Each shape is timed with PyTorch's default backend choice and with every backend that accepts it
(flash, efficient, cudnn, math); "best" is the fastest of those.

Decode shapes are also timed as CUDA graphs ("graph_*" fields): --graph-calls N (default 20, the same N as
bench_kernels) back-to-back calls (input set i % sets, as in plain timing) captured in one torch.cuda.CUDAGraph;
after warm-up, >= 50 replays each timed with its own CUDA event pair; time per call = replay time / N. This takes
PyTorch's per-call host dispatch out of the measurement (at B=8 T=2k it is of the order of the kernel time, which
made the plain-timed T=2k median bimodal). Graph timing covers the default dispatch and every backend except math
(math materialises the GQA-expanded K/V and is never the fastest decode path); a backend whose capture fails is
recorded with its error.

Usage: sdpa_peer.py --out sdpa_peer.json [--iters N] [--warmup N] [--graph-calls N] [--no-graph] [--quick]
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


def time_graph(fn, sets, iters, warmup, calls):
    """fn(i % sets) for i < calls captured in one CUDA graph; median etc. of per-call time over `iters` replays."""
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    # Capture warms up on a side stream first (PyTorch's recommendation), so lazy initialisation stays out of it.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i % sets)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [fn(i % sets) for i in range(calls)]
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in events:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    us = sorted(1000.0 * a.elapsed_time(b) / calls for a, b in events)
    del outs, g
    return {"median_us": us[len(us) // 2], "p10_us": us[len(us) // 10], "p90_us": us[(len(us) * 9) // 10],
            "min_us": us[0], "iters": iters, "calls_per_graph": calls}


def graph_backends(call, sets, args):
    """Graph timing of the default dispatch and of each backend but math; returns ({name: timing or error}, best)."""
    out = {}
    for name, be in [("default", None)] + [(k, v) for k, v in BACKENDS.items() if k != "math"]:
        try:
            if be is None:
                out[name] = time_graph(call, sets, args.iters, args.warmup, args.graph_calls)
            else:
                with sdpa_kernel([be]):
                    out[name] = time_graph(call, sets, args.iters, args.warmup, args.graph_calls)
        except Exception as e:  # backend rejects the shape, or its capture fails
            out[name] = {"error": str(e).splitlines()[0][:200] if str(e) else type(e).__name__}
            try:
                torch.cuda.synchronize()
            except Exception:
                pass
    timed = {k: v for k, v in out.items() if "median_us" in v}
    best = min(timed, key=lambda k: timed[k]["median_us"]) if timed else None
    return out, best


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
    ap.add_argument("--graph-calls", type=int, default=20)
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    args.graph_calls = max(1, args.graph_calls)
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

    doc = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": os.environ.get("SPADE_COMMIT") or "unknown",
        "copy_gb_per_s": copy_gbps,
        "iters": args.iters,
        "warmup": args.warmup,
        "graph_calls": args.graph_calls,
        "timing": "plain: median of per-call CUDA event pairs after warm-up; graph_*: median over replays of a CUDA "
                  "graph of graph_calls back-to-back calls, per call; inputs rotated over sets >= 4x L2",
        "results": results,
    }

    def write():  # after every case, so a failure later in the run keeps what was measured
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)

    decode_shapes = [(8, 2048), (8, 2112), (8, 8192), (8, 32768)]
    if not args.quick:
        decode_shapes += [(1, 32768), (32, 4096), (8, 131072)]
    cases = [("bf16", torch.bfloat16, b, T) for b, T in decode_shapes] + [("fp16", torch.float16, 8, 32768)]

    def decode_inputs(batch, T, dtype):
        kv_bytes = 2.0 * batch * HKV * T * D * 2
        sets = rotation_sets(kv_bytes, l2)
        qs = [torch.randn(batch, HQ, 1, D, device=dev, dtype=dtype) for _ in range(sets)]
        ks = [torch.randn(batch, HKV, T, D, device=dev, dtype=dtype) for _ in range(sets)]
        vs = [torch.randn(batch, HKV, T, D, device=dev, dtype=dtype) for _ in range(sets)]

        def call(s):
            return F.scaled_dot_product_attention(qs[s], ks[s], vs[s], enable_gqa=True)

        return call, sets, kv_bytes

    # Plain timing of every decode shape first, then the CUDA-graph pass (a failed capture cannot spoil the former).
    decode_rows = {}
    for dtype_name, dtype, batch, T in cases:
        call, sets, kv_bytes = decode_inputs(batch, T, dtype)
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
        decode_rows[(dtype_name, batch, T)] = r
        write()
        print(f"{r['name']:<40} default {r['median_us']:9.1f} us {r['gb_per_s']:8.1f} GB/s; best {best} "
              f"{r['best_median_us']:9.1f} us", flush=True)
        del call
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
        write()
        print(f"{r['name']:<40} default {r['median_us']:9.1f} us {r['tflop_per_s']:6.1f} TFLOP/s; best {best} "
              f"{r['best_median_us']:9.1f} us", flush=True)
        del q, k, v
        torch.cuda.empty_cache()

    if not args.no_graph:
        for dtype_name, dtype, batch, T in cases:
            r = decode_rows[(dtype_name, batch, T)]
            call, sets, _ = decode_inputs(batch, T, dtype)
            gt, gbest = graph_backends(call, sets, args)
            r["graph_backends"] = gt
            line = f"{r['name']:<40} graph:"
            if gbest is not None:
                r["graph_best_backend"] = gbest
                r["graph_best_median_us"] = gt[gbest]["median_us"]
                if "median_us" in gt["default"]:
                    r["graph_median_us"] = gt["default"]["median_us"]
                    line += f" default {r['graph_median_us']:9.1f} us;"
                line += f" best {gbest} {r['graph_best_median_us']:9.1f} us"
            else:
                line += " no backend could be captured: " + "; ".join(f"{k}: {v.get('error')}" for k, v in gt.items())
            write()
            print(line, flush=True)
            del call
            torch.cuda.empty_cache()

    write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
