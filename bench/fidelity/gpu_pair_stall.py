#!/usr/bin/env python3
"""Stress of the in-process GPU pair (`inference_rank --device cuda --selection predicted`, both ranks in one process
over CUDA IPC): runs the pass-key workload of bench/fidelity/passkey_gpu.py (the same flags; --extra-flags replace
them) RUNS times, JOBS at a time, and classifies every run:
  ok        exit 0, no failed request
  stalled   a link operation missed its deadline ("not complete N ms after it was posted"): the pair stalled
  failed    another non-zero exit (its status; CLI11's 114 is an option given twice)
  hung      still running after --timeout seconds (killed; its threads' stacks are saved first, OUT/run-<i>.stacks,
            when gdb or cuda-gdb exists: with --extra-flags="--selection-deadline-ms 30000" a stall outlasts it)
Each run's stderr goes to OUT/run-<i>.log (the link logs its state at a failure), stdout to OUT/run-<i>.out. Exits 1
when any run is not ok.

  bench/fidelity/gpu_pair_stall.py --inference-rank build-gpu/inference_rank/inference_rank \\
      --model models/longctx-7m --bytes 1000 --budget 40 --runs 10 --jobs 2 --extra-flags=--no-cuda-graphs --out DIR
"""
import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from passkey_gpu import add_inference_rank_args, resolve_inputs  # noqa: E402


def stacks(pid, path):
    gdb = shutil.which("gdb") or shutil.which("cuda-gdb")
    if not gdb:
        return "no gdb"
    r = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt 12"], capture_output=True,
                       text=True, timeout=60)
    with open(path, "w") as f:
        f.write(r.stdout + r.stderr)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_inference_rank_args(ap, "--prompts", "prompts/passkey_public.jsonl")
    ap.add_argument("--bytes", type=int, default=1000)
    ap.add_argument("--budget", type=int, default=40)
    ap.add_argument("--layers-per-pack", type=int, default=2)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--extra-flags", default="")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the runs (e.g. CUDA_LAUNCH_BLOCKING=1)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    resolve_inputs(a, "gpu_pair_stall", "prompts", "pass-key prompts")
    os.makedirs(a.out, exist_ok=True)
    with open(a.prompts) as f:
        prompts = [p for p in map(json.loads, f) if p["bytes"] == a.bytes]
    extra = shlex.split(a.extra_flags)
    given = {t.split("=", 1)[0] for t in extra if t.startswith("--")}  # --extra-flags replace the defaults below
    defaults = [("--model", a.model), ("--device", "cuda"), ("--chat", None), ("--temperature", "0"),
                ("--max-tokens", "48"), ("--sparse-threshold", "256"), ("--layers-per-pack", str(a.layers_per_pack)),
                ("--max-num-seqs", str(len(prompts))), ("--max-num-batched-tokens", "8192"), ("--kv-cache-gib", "16"),
                ("--log-level", "warn"), ("--selection", "predicted"), ("--token-budget", str(a.budget))]
    cmd = [a.inference_rank]
    for name, value in defaults:
        if name not in given:
            cmd += [name] + ([value] if value is not None else [])
    cmd += extra
    for p in prompts:
        cmd += ["--prompt", p["prompt"]]
    env = dict(os.environ)
    for e in a.env:
        k, v = e.split("=", 1)
        env[k] = v
    results, running, next_run = {}, {}, 0
    while len(results) < a.runs:
        while next_run < a.runs and len(running) < a.jobs:
            log = open(os.path.join(a.out, f"run-{next_run}.log"), "w")
            out = open(os.path.join(a.out, f"run-{next_run}.out"), "w")
            running[next_run] = (subprocess.Popen(cmd, stdout=out, stderr=log, env=env), time.time(), log, out)
            next_run += 1
        time.sleep(0.2)
        for i, (proc, t0, log, out) in list(running.items()):
            rc = proc.poll()
            if rc is None and time.time() - t0 < a.timeout:
                continue
            if rc is None:
                where = stacks(proc.pid, os.path.join(a.out, f"run-{i}.stacks"))
                proc.kill()
                proc.wait()
                verdict, rc = f"hung (killed after {a.timeout:.0f} s; stacks: {where})", "killed"
            log.close()
            out.close()
            text = open(os.path.join(a.out, f"run-{i}.log")).read()
            answers = open(os.path.join(a.out, f"run-{i}.out")).read()
            if rc == "killed":
                pass
            elif "after it was posted" in text:
                verdict = "stalled"
            elif rc != 0:
                verdict = f"failed (exit {rc})"
            else:
                verdict = "ok"
            right = sum(p["expect"] in r for p, r in
                        zip(prompts, re.split(r"^=== prompt \d+ ===\n", answers, flags=re.M)[1:]))
            secs = time.time() - t0
            results[i] = verdict
            tail = " | ".join(l for l in text.splitlines() if "[spade]" in l or "error" in l.lower())[-600:]
            print(f"run {i}: {verdict} in {secs:.1f} s, {right}/{len(prompts)} pass keys; {tail}", flush=True)
            del running[i]
    bad = sum(v != "ok" for v in results.values())
    print(f"{a.runs - bad}/{a.runs} runs ok", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
