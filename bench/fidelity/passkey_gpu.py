#!/usr/bin/env python3
"""Pass-key fidelity of the GPU path (bf16): the same prompts and table as passkey_fidelity (the CPU path), run
through `inference_rank --device cuda` — the GPU model, the GPU cache rank in the same process over CUDA IPC, CUDA
graphs — with greedy decoding.

The GPU cache rank's token budget is one per run (the pair hello), so prompts are grouped by size (1000 / 2000 /
4000 / 7600 bytes) and a fractional budget is resolved against the largest prompt of the group (rounded up). Every
mode of the CPU path runs here too: dense, oracle and quest (synchronous, with the true query, in the inference rank's
forward pass: inference_rank/gpu_sync_selection.h) and predicted (the GPU cache rank).

Variants: NAME=flags, the flags passed to inference_rank as they are, e.g.
    oracle="--selection oracle"
    predicted="--selection predicted"
    paper="--selection predicted --predictor paper --ridge-eps 1e-3 --successor-expand false"
    last="--selection predicted --predictor last --successor-expand false"
    delta32="--selection predicted --delta-capacity 32"   (GPU path only: --device cpu refuses --delta-capacity)
    delta-k/8="--selection predicted --delta-capacity {budget/8}"   ({budget/N}: ceil(the run's token budget / N))

Writes a JSON (device, date, commit, every reply) and a Markdown table; with --min-accuracy VARIANT=FRACTION it exits 1
when a variant answers fewer prompts than that (the gpu test's assertion).

  bench/fidelity/passkey_gpu.py --inference-rank build-gpu/inference_rank/inference_rank \
      --model DATA/models/longctx-22m --budgets 64,128,1/16,1/32 --json-out X.json --md-out X.md
"""
import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time

DEFAULT_VARIANTS = [
    ("dense", "--selection dense"),
    ("oracle", "--selection oracle"),  # synchronous exact token top-k with the true query (gpu_sync_selection.h)
    ("quest", "--selection quest"),  # synchronous Quest-style page top-k with the true query
    ("predicted", "--selection predicted"),  # prompt anchors on (the default)
    ("no-anchors", "--selection predicted --anchor-queries 0"),
    ("paper", "--selection predicted --predictor paper --ridge-eps 1e-3 --successor-expand false"),
    ("last", "--selection predicted --predictor last --successor-expand false"),
]


def data_path(rel):
    """A file of the shared test data: $SPADE_DATA_DIR (default ../shared/data) / rel."""
    return os.path.join(os.environ.get("SPADE_DATA_DIR", "../shared/data"), rel)


def add_inference_rank_args(ap, data_flag, data_rel, data_help=None):
    """The arguments of every fidelity script that runs inference_rank: the binary, the model (a directory or a model
    name of the shared data) and the script's data file (`data_flag`, default data_path(data_rel))."""
    ap.add_argument("--inference-rank", required=True)
    ap.add_argument("--model", required=True, help="checkpoint directory, or a model name of $SPADE_DATA_DIR/models")
    ap.add_argument(data_flag, default=data_path(data_rel), help=data_help)


def add_run_args(ap, layers_help=None):
    """inference_rank_command's settings, and the outputs (--json-out, --md-out)."""
    ap.add_argument("--device", default="cuda", help="cuda (the GPU path); cpu only to try the script itself")
    ap.add_argument("--sparse-threshold", type=int, default=256)
    ap.add_argument("--layers-per-pack", type=int, default=2, help=layers_help)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--extra-flags", default="", help="inference_rank flags added to every run (e.g. --no-cuda-graphs)")
    ap.add_argument("--json-out")
    ap.add_argument("--md-out")


def resolve_inputs(a, tool, data_attr, data_what):
    """A bare model name becomes the shared data's model; exits naming what is missing."""
    if not os.path.isdir(a.model):
        a.model = data_path(os.path.join("models", a.model))
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        sys.exit(f"{tool}: no checkpoint at {a.model} (set SPADE_DATA_DIR)")
    if not os.path.isfile(getattr(a, data_attr)):
        sys.exit(f"{tool}: no {data_what} at {getattr(a, data_attr)} (set SPADE_DATA_DIR)")


def chat_tokens(prompt):
    # The byte-level longctx tokenizer with its ChatML template: "<|im_start|>user\n" + prompt + "<|im_end|>\n" +
    # "<|im_start|>assistant\n", one token per byte plus the three special tokens.
    return len(prompt.encode()) + 19


def parse_budget(s):
    if "/" in s:
        a, b = s.split("/")
        return None, float(a) / float(b)
    return int(s), None


def flag_names(tokens):
    """The option names among inference_rank arguments ("--layers-per-pack 6" and "--layers-per-pack=6" alike)."""
    return {t.split("=", 1)[0] for t in tokens if t.startswith("--")}


def inference_rank_command(args, flags, texts, budget, own_defaults):
    """inference_rank with the settings every fidelity script gives (model, device, sparse threshold, pack size, one
    batch of every text, the budget) plus `own_defaults` [(flag, value or None)], each left out when the variant or
    --extra-flags gives it: inference_rank refuses an option given twice (CLI11's ArgumentMismatch, exit status 114),
    e.g. a variant's --layers-per-pack 6. {budget/N} in `flags` becomes ceil(budget / N) (resolve_budget_refs)."""
    own = shlex.split(resolve_budget_refs(flags, budget)) + shlex.split(args.extra_flags)
    given = flag_names(own)
    defaults = [("--model", args.model), ("--device", args.device)] + own_defaults + [
        ("--sparse-threshold", str(args.sparse_threshold)), ("--layers-per-pack", str(args.layers_per_pack)),
        ("--max-num-seqs", str(len(texts))), ("--max-num-batched-tokens", "8192"), ("--kv-cache-gib", "16"),
        ("--log-level", "warn")]
    if budget:
        defaults.append(("--token-budget", str(budget)))
    cmd = [args.inference_rank]
    for name, value in defaults:
        if name not in given:
            cmd += [name] + ([value] if value is not None else [])
    cmd += own
    for t in texts:
        cmd += ["--prompt", t]
    return cmd


def device_names(device):
    """The GPUs' names (nvidia-smi) for --device cuda; for another device, a marker that the run only checks a script."""
    if device != "cuda":
        return [f"{device} (not the GPU path: a check of this script)"]
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout.strip().splitlines()
    except OSError:
        return []


def run_record(tool, path, dev, a, variants, **fields):
    """The JSON record of a fidelity run: tool, path, device, date, commit, the variants and their flags, then
    `fields` (the tool's settings and results)."""
    out = {"tool": tool, "path": path, "device": dev, "model": a.model,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "commit": os.environ.get("SPADE_COMMIT", "unknown"), "sparse_threshold": a.sparse_threshold,
           "variants": [{"name": n, "flags": f} for n, f in variants], "extra_flags": a.extra_flags}
    out.update(fields)
    return out


def write_outputs(a, text, out):
    """Writes the JSON record to --json-out and the markdown table to --md-out, where given."""
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)
    if a.md_out:
        with open(a.md_out, "w") as f:
            f.write(text)


def resolve_budget_refs(flags, budget):
    """Replaces each {budget/N} in a variant's flags by ceil(budget / N), the run's own token budget (a fraction's
    budget differs per prompt size group), e.g. a delta capacity of an eighth of the budget."""
    def one(m):
        if not budget:
            raise ValueError(f"{m.group(0)} in '{flags}' needs a token budget (not a dense variant)")
        return str(max(1, math.ceil(budget / int(m.group(1)))))
    return re.sub(r"\{budget/(\d+)\}", one, flags)


def run_group(args, flags, prompts, budget):
    cmd = inference_rank_command(args, flags, [p["prompt"] for p in prompts], budget,
                                 [("--chat", None), ("--temperature", "0"), ("--max-tokens", str(args.max_new_tokens))])
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    failed = [l for l in r.stderr.splitlines() if re.match(r"request \d+ failed", l)]
    if r.returncode != 0:
        # Keep the run: its failed requests count as wrong answers and the run is marked (a selection that does not
        # arrive is a fidelity loss too); anything else is an error of this script's caller.
        sys.stderr.write(f"inference_rank exited {r.returncode} ({len(failed)} failed requests): {flags} budget "
                         f"{budget}\n{r.stderr[-1500:]}\n")
        if not failed:
            tail = " | ".join(r.stderr.strip().splitlines()[-3:])
            raise RuntimeError(f"inference_rank failed ({r.returncode}): {flags} budget {budget}: {tail}")
    # "=== prompt i ===\n<text>\n" per prompt (batched output of inference_rank).
    parts = re.split(r"^=== prompt (\d+) ===\n", r.stdout, flags=re.M)
    replies = {}
    for i in range(1, len(parts), 2):
        replies[int(parts[i])] = parts[i + 1].rstrip("\n")
    if len(replies) != len(prompts):
        raise RuntimeError(f"{len(replies)} replies for {len(prompts)} prompts: {flags}")
    stats = [l for l in r.stderr.splitlines() if l.startswith("[spade]")] + (
        [f"FAILED requests: {len(failed)}"] if failed else [])
    return [replies[i] for i in range(len(prompts))], stats, time.time() - t0, len(failed)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_inference_rank_args(ap, "--prompts", "prompts/passkey_public.jsonl")
    ap.add_argument("--bytes", default="", help="only these prompt sizes, e.g. 1000,2000")
    ap.add_argument("--per-group", type=int, default=1000, help="first N prompts of each (bytes, needles) group")
    ap.add_argument("--budgets", default="64,128,256,512,1024,1/8,1/16,1/32,1/64")
    ap.add_argument("--variant", action="append", default=[], help="NAME=inference_rank flags (repeatable)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    add_run_args(ap, layers_help="unless a variant or --extra-flags gives --layers-per-pack (then that one applies)")
    ap.add_argument("--min-accuracy", action="append", default=[],
                    help="VARIANT@BUDGET=FRACTION: exit 1 when below (e.g. predicted@1/16=0.9)")
    a = ap.parse_args()
    resolve_inputs(a, "passkey_gpu", "prompts", "pass-key prompts")
    variants = DEFAULT_VARIANTS if not a.variant else [tuple(v.split("=", 1)) for v in a.variant]
    want = {int(b) for b in a.bytes.split(",") if b}
    prompts, seen = [], {}
    with open(a.prompts) as f:
        for line in f:
            p = json.loads(line)
            if want and p["bytes"] not in want:
                continue
            key = (p["bytes"], p["needles"])
            seen[key] = seen.get(key, 0) + 1
            if seen[key] <= a.per_group:
                prompts.append(p)
    groups = {}
    for p in prompts:
        groups.setdefault(p["bytes"], []).append(p)
    budgets = [b for b in a.budgets.split(",") if b]

    runs, acc, errors = [], {}, []
    for vname, flags in variants:
        dense = "--selection dense" in flags
        for bname in (["full"] if dense else budgets):
            tok, frac = parse_budget(bname) if not dense else (None, None)
            # One process for every prompt when the budget is absolute (or dense); one per size group for a fraction.
            batches = sorted(groups.items()) if frac else [("all", prompts)]
            for size, ps in batches:
                budget = None
                if not dense:
                    budget = tok if tok else max(1, math.ceil(frac * max(chat_tokens(p["prompt"]) for p in ps)))
                replies, stats, secs, nfailed = run_group(a, flags, ps, budget)
                if nfailed:
                    errors.append({"variant": vname, "budget": bname, "group": size, "failed_requests": nfailed})
                for p, r in zip(ps, replies):
                    ok = p["expect"] in r
                    c = acc.setdefault((vname, bname), {}).setdefault(p["bytes"], [0, 0])
                    c[0] += ok
                    c[1] += 1
                    runs.append({"prompt_id": p["id"], "bytes": p["bytes"], "needles": p["needles"],
                                 "variant": vname, "budget": bname, "budget_tokens": budget, "correct": ok,
                                 "reply": r})
                got = sum(p["expect"] in r for p, r in zip(ps, replies))
                print(f"{vname}@{bname} {size} B (budget {budget}): {got}/{len(ps)} [{secs:.1f} s] {' '.join(stats)}",
                      file=sys.stderr, flush=True)

    sizes = sorted(groups)
    dev = device_names(a.device)
    md = [f"### Pass-key accuracy, GPU (bf16, {dev[0] if dev else 'GPU'}), {a.model} ({len(prompts)} prompts)", "",
          "| variant | budget | " + " | ".join(f"{s} B" for s in sizes) + " | all |",
          "|---|---|" + "---:|" * (len(sizes) + 1)]
    summary = []
    for (vname, bname), by in acc.items():
        c = sum(v[0] for v in by.values())
        t = sum(v[1] for v in by.values())
        md.append(f"| {vname} | {bname} | " + " | ".join(f"{by[s][0]}/{by[s][1]}" if s in by else "–" for s in sizes)
                  + f" | {c}/{t} |")
        summary.append({"variant": vname, "budget": bname, "correct": c, "total": t})
    for e in errors:
        md.append(f"\nFAILED: {e['variant']}@{e['budget']} ({e['group']} B): {e['failed_requests']} requests failed "
                  "(counted as wrong)")
    text = "\n".join(md) + "\n"
    print(text)
    out = run_record("passkey_gpu", "gpu-bf16", dev, a, variants, prompts=a.prompts,
                     layers_per_pack=a.layers_per_pack, max_new_tokens=a.max_new_tokens, summary=summary,
                     failed_runs=errors, runs=runs)
    write_outputs(a, text, out)
    status = 1 if errors else 0
    for m in a.min_accuracy:
        key, frac = m.split("=")
        vname, bname = key.split("@")
        c = sum(v[0] for v in acc[(vname, bname)].values())
        t = sum(v[1] for v in acc[(vname, bname)].values())
        if c < float(frac) * t:
            print(f"FAIL: {vname} at budget {bname} answered {c}/{t} < {frac}", file=sys.stderr)
            status = 1
        else:
            print(f"ok: {vname} at budget {bname} answered {c}/{t} >= {frac}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
