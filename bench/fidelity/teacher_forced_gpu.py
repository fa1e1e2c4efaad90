#!/usr/bin/env python3
"""Teacher-forced fidelity of the GPU path (bf16) on held-out code: the metrics passkey_fidelity --heldout-docs
computes on the CPU path, through `inference_rank --device cuda --host-sampling --teacher-force N`.

Each document of heldout_code_py.txt (separated by <|endoftext|>, at least --context + --forced bytes, cut to that)
is one prompt: its first --context bytes are prefilled, its last --forced tokens are forced one decode step each
(GenerateRequest::forced_tokens), so every variant decodes exactly the same tokens. Per variant and budget:
  bits per token of the forced tokens (= per byte for the byte-level longctx models), and the difference to dense;
  top-1 agreement: the share of forced steps whose argmax equals dense's at the same step.
A fractional budget is resolved against --context (bytes: the prompt tokens of the byte-level longctx models; rounds
up). The first --skip forced steps are not scored (default 2: the prefill's token and the token of the step that
switches to sparse decoding are dense in every variant). Dense runs first (the reference).
Predicted variants (--selection predicted) also get --overlap-sample-every 1: the in-process cache rank measures, at
every sparse step, the overlap ratio (AsyncSpade Eq. 1: the held selection against the top-k of that step's true
query under the same rules, no anchors) and the selection churn (share of the selection that entered this step),
per layer and KV head (cache_rank/gpu_server.h, "Sampling"); all sparse steps count, not only the scored ones.

  bench/fidelity/teacher_forced_gpu.py --inference-rank build-gpu/inference_rank/inference_rank \\
      --model DATA/models/longctx-22m --docs 16 --context 4000 --forced 64 --budgets 1/16,1/32 --json-out X.json --md-out X.md
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from passkey_gpu import (DEFAULT_VARIANTS, add_inference_rank_args, add_run_args, device_names,  # noqa: E402
                         inference_rank_command, parse_budget, resolve_inputs, run_record, write_outputs)


def read_docs(path, nbytes, count):
    text = open(path, "rb").read()
    docs = []
    for d in text.split(b"<|endoftext|>"):
        if len(d) >= nbytes:
            docs.append(d[:nbytes].decode("utf-8", errors="ignore"))
        if len(docs) == count:
            break
    if len(docs) < count:
        sys.exit(f"teacher_forced_gpu: only {len(docs)} documents of >= {nbytes} bytes in {path} (wanted {count})")
    return docs


def is_predicted(flags):
    return "--selection predicted" in flags


def run(args, flags, docs, budget):
    cmd = inference_rank_command(args, flags, docs, budget, [("--teacher-force", str(args.forced))] +
                                 ([("--host-sampling", None)] if args.device == "cuda" else []) +
                                 ([("--overlap-sample-every", "1")] if is_predicted(flags) else []))
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        tail = " | ".join(r.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"inference_rank failed ({r.returncode}): {flags} budget {budget}: {tail}")
    rows, samples = {}, None
    for line in r.stdout.splitlines():
        if line.startswith('{"teacher_forced"'):
            j = json.loads(line)
            rows[j["teacher_forced"]] = j
        elif line.startswith('{"selection_samples"'):
            samples = json.loads(line)["selection_samples"]
    if is_predicted(flags) and (samples is None or not samples["overlap_n"]):
        raise RuntimeError(f"no sampled overlap from the cache rank: {flags} budget {budget}")
    if len(rows) != len(docs) or any(len(v["logprob"]) != args.forced for v in rows.values()) or args.skip >= args.forced:
        raise RuntimeError(f"{len(rows)} teacher-forced rows for {len(docs)} documents: {flags}")
    stats = [l for l in r.stderr.splitlines() if l.startswith("[spade]")]
    return [rows[i] for i in range(len(docs))], stats, samples, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_inference_rank_args(ap, "--heldout", "prompts/heldout_code_py.txt")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--context", type=int, default=4000, help="prefilled bytes per document")
    ap.add_argument("--forced", type=int, default=64, help="forced tokens (decode steps) per document")
    ap.add_argument("--skip", type=int, default=2,
                    help="forced steps not scored: the prefill's and the switch step's tokens, dense in every variant")
    ap.add_argument("--budgets", default="1/16,1/32")
    ap.add_argument("--variant", action="append", default=[], help="NAME=inference_rank flags (repeatable)")
    add_run_args(ap)
    a = ap.parse_args()
    resolve_inputs(a, "teacher_forced_gpu", "heldout", "held-out code")
    variants = DEFAULT_VARIANTS if not a.variant else [tuple(v.split("=", 1)) for v in a.variant]
    if not any("--selection dense" in f for _, f in variants):
        variants = [("dense", "--selection dense")] + variants  # the reference
    variants = sorted(variants, key=lambda v: "--selection dense" not in v[1])
    docs = read_docs(a.heldout, a.context + a.forced, a.docs)

    dense_argmax, dense_bits, results = None, None, []
    for vname, flags in variants:
        dense = "--selection dense" in flags
        for bname in (["full"] if dense else [b for b in a.budgets.split(",") if b]):
            tok, frac = parse_budget(bname) if not dense else (None, None)
            budget = None if dense else (tok if tok else max(1, math.ceil(frac * a.context)))
            rows, stats, samples, secs = run(a, flags, docs, budget)
            # Scored steps: from --skip on (the first forced token comes from the prefill, the second from the
            # step that switches to sparse, which decodes densely: both are dense in every variant).
            lps = [r["logprob"][a.skip:] for r in rows]
            if any(lp is None for row in lps for lp in row):
                raise RuntimeError(f"{vname}@{bname}: a forced token's logprob is not finite (NaN or -inf logits)")
            nll = -sum(sum(row) for row in lps)
            n = sum(len(row) for row in lps)
            bits = nll / n / math.log(2)
            argmax = [r["argmax"][a.skip:] for r in rows]
            if dense_argmax is None:
                dense_argmax, dense_bits = argmax, bits
            agree = sum(x == y for ra, rd in zip(argmax, dense_argmax) for x, y in zip(ra, rd)) / n
            results.append({"variant": vname, "budget": bname, "budget_tokens": budget, "bits_per_token": bits,
                            "delta_bits_vs_dense": bits - dense_bits, "top1_agreement_with_dense": agree,
                            "tokens": n, "seconds": secs, "stats": stats, "selection_samples": samples})
            sampled = (f", overlap {samples['overlap']:.3f}, churn {samples['churn']:.3f}" if samples else "")
            print(f"{vname}@{bname} (budget {budget}): {bits:.4f} bits/token ({bits - dense_bits:+.4f}), top-1 "
                  f"{100 * agree:.1f} %{sampled} [{secs:.1f} s] {' '.join(stats)}", file=sys.stderr, flush=True)

    dev = device_names(a.device)
    md = [f"### Teacher-forced on held-out code, GPU (bf16, {dev[0] if dev else 'GPU'}), {a.model}: {a.docs} documents, "
          f"{a.context} bytes prefilled + {a.forced} forced tokens each", "",
          "| variant | budget | bits per token | vs dense | top-1 agreement with dense | overlap ratio (Eq. 1), "
          "layers | churn per step |", "|---|---|---:|---:|---:|---:|---:|"]

    def layer_range(s, key):
        per_layer = []
        for heads in s["layers"]:
            n = sum(h[key + "_n"] for h in heads)
            if n:
                per_layer.append(sum(h[key] * h[key + "_n"] for h in heads if h[key] is not None) / n)
        return f" ({min(per_layer):.2f}-{max(per_layer):.2f})" if per_layer else ""

    for r in results:
        s = r["selection_samples"]
        ov = f"{s['overlap']:.3f}{layer_range(s, 'overlap')}" if s else ""
        ch = f"{s['churn']:.3f}" if s else ""
        md.append(f"| {r['variant']} | {r['budget']} | {r['bits_per_token']:.4f} | {r['delta_bits_vs_dense']:+.4f} | "
                  f"{100 * r['top1_agreement_with_dense']:.1f} % | {ov} | {ch} |")
    text = "\n".join(md) + "\n"
    print(text)
    out = run_record("teacher_forced_gpu", "gpu-bf16" if a.device == "cuda" else a.device, dev, a, variants,
                     heldout=a.heldout, docs=a.docs, context_bytes=a.context, forced=a.forced, results=results)
    write_outputs(a, text, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
