#!/usr/bin/env python3
"""Merges bench_kernels.json and sdpa_peer.json (one run_gpu.sh run) into a markdown table and a summary JSON.

Usage: report.py KERNELS.json SDPA.json [--json summary.json]   (markdown on stdout)
Ratios: "x SDPA" = SDPA median time / our median time on the same shape (> 1: we are faster); "% copy" = our GB/s
over the device-to-device copy bandwidth measured by bench_kernels in the same run; "paged / contiguous" = paged
median time / contiguous-layout median time of the same shape. "plain" columns: per-call CUDA event pairs; "graph"
columns: per-call time of CUDA-graph replays of N back-to-back calls (both sides the same N and input rotation), which
removes host launch / dispatch overhead. Placement: shuffled (random page permutation), ascending, allocator
(common/page_allocator after simulated serving churn), contiguous (bench/bench_kernels.cu header).
"""
import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kernels")
    ap.add_argument("sdpa")
    ap.add_argument("--json")
    args = ap.parse_args()
    with open(args.kernels) as f:
        kern = json.load(f)
    try:
        with open(args.sdpa) as f:
            sdpa = json.load(f)
    except (OSError, ValueError):
        sdpa = {"results": []}
    copy = kern["copy_gb_per_s"]
    ours = {r["name"]: r for r in kern["results"]}
    peer = {r["name"]: r for r in sdpa["results"]}
    lines = [f"Device: {kern['device']} | date {kern['date']} | commit {kern['commit']} | "
             f"copy bandwidth {copy:.0f} GB/s (read+write, 1 GiB D2D) | torch {sdpa.get('torch', 'n/a')}",
             "",
             "| case | placement | ours plain (us) | ours GB/s | % copy | SDPA default (us) | SDPA best (us, backend) |"
             " x SDPA default | x SDPA best | ours graph (us) | SDPA graph best (us, backend) | x SDPA best, graph |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    summary = {"device": kern["device"], "date": kern["date"], "commit": kern["commit"], "copy_gb_per_s": copy,
               "rows": []}

    def add_row(name, peer_name):
        r = ours.get(name)
        if r is None:
            return
        p = peer.get(peer_name) if peer_name else None
        row = {"case": name, "placement": r.get("placement", ""), "ours_us": r["median_us"],
               "ours_gb_per_s": r["gb_per_s"], "ratio_to_copy": r["ratio_to_copy"]}
        g = r.get("graph")
        if g is not None:
            row.update(ours_graph_us=g["median_us"], ours_graph_gb_per_s=g["gb_per_s"],
                       ours_graph_ratio_to_copy=g["ratio_to_copy"])
        cells = [name, r.get("placement", ""), f"{r['median_us']:.1f}", f"{r['gb_per_s']:.0f}",
                 f"{100 * r['ratio_to_copy']:.1f}%"]
        if p is not None:
            row.update(sdpa_case=peer_name, sdpa_default_us=p["median_us"], sdpa_best_us=p["best_median_us"],
                       sdpa_best_backend=p["best_backend"], speedup_vs_default=p["median_us"] / r["median_us"],
                       speedup_vs_best=p["best_median_us"] / r["median_us"])
            cells += [f"{p['median_us']:.1f}", f"{p['best_median_us']:.1f} ({p['best_backend']})",
                      f"{row['speedup_vs_default']:.2f}x", f"{row['speedup_vs_best']:.2f}x"]
        else:
            cells += ["", "", "", ""]
        cells.append(f"{g['median_us']:.1f}" if g is not None else "")
        if g is not None and p is not None and "graph_best_median_us" in p:
            row.update(sdpa_graph_best_us=p["graph_best_median_us"], sdpa_graph_best_backend=p["graph_best_backend"],
                       speedup_vs_best_graph=p["graph_best_median_us"] / g["median_us"])
            if "graph_median_us" in p:
                row.update(sdpa_graph_default_us=p["graph_median_us"],
                           speedup_vs_default_graph=p["graph_median_us"] / g["median_us"])
            cells += [f"{p['graph_best_median_us']:.1f} ({p['graph_best_backend']})",
                      f"{row['speedup_vs_best_graph']:.2f}x"]
        else:
            cells += ["", ""]
        summary["rows"].append(row)
        lines.append("| " + " | ".join(cells) + " |")

    for r in kern["results"]:
        name = r["name"]
        if r["kind"] == "paged_decode":
            sh = r["shape"]
            add_row(name, f"sdpa_decode_{r['dtype']}_B{sh['batch']}_T{sh['seq_len']}")
        elif r["kind"] in ("sparse_decode_indexed", "sparse_decode_packed"):
            sh = r["shape"]
            tokens = sh["selected"] + sh.get("local_window", 0)
            add_row(name, f"sdpa_decode_bf16_B{sh['batch']}_T{tokens}" if tokens == 2112 else None)
        elif r["kind"] == "copy" or r["kind"].startswith("selection_"):
            add_row(name, None)

    gemms = [r for r in kern["results"] if r["kind"] == "gemm"]
    if gemms:
        lines += ["", "| decode GEMM (graph) | m | n x k | cuBLASLt (us, % of copy) | small-M split-K (us, % of copy, "
                  "splits) | cuBLASLt / small-M | floor (us) |", "|---|---:|---|---:|---:|---:|---:|"]
        summary["gemm"] = []
        for r in gemms:
            sm = r.get("small_m")
            smc = f"{sm['median_us']:.1f} ({100 * sm['ratio_to_copy']:.0f}%, {sm['splits']})" if sm else "-"
            ratio = f"{r['cublaslt_over_small_m']:.2f}" if sm else "-"
            lines.append(f"| {r['model']} {r['proj']} | {r['m']} | {r['n']} x {r['k']} | {r['median_us']:.1f} "
                         f"({100 * r['ratio_to_copy']:.0f}%) | {smc} | {ratio} | {r['floor_us']:.1f} |")
            summary["gemm"].append({"case": r["name"], "cublaslt_us": r["median_us"],
                                    "cublaslt_ratio_to_copy": r["ratio_to_copy"],
                                    "small_m_us": sm["median_us"] if sm else None, "floor_us": r["floor_us"]})

    lines += ["", "| paged vs contiguous (same B, T) | placement | paged (us) | contiguous (us) | paged / contiguous |"
              " paged / contiguous, graph |", "|---|---|---:|---:|---:|---:|"]
    for r in kern["results"]:
        if r["kind"] == "paged_decode" and r["layout"].startswith("paged"):
            sh = r["shape"]
            c = ours.get(f"paged_decode_{r['dtype']}_B{sh['batch']}_T{sh['seq_len']}_contiguous")
            if c is not None:
                ratio = r["median_us"] / c["median_us"]
                entry = {"case": r["name"], "placement": r.get("placement", ""), "paged_over_contiguous": ratio}
                gcell = ""
                if "graph" in r and "graph" in c:
                    entry["paged_over_contiguous_graph"] = r["graph"]["median_us"] / c["graph"]["median_us"]
                    gcell = f"{entry['paged_over_contiguous_graph']:.3f}"
                lines.append(f"| {r['name']} | {r.get('placement', '')} | {r['median_us']:.1f} | "
                             f"{c['median_us']:.1f} | {ratio:.3f} | {gcell} |")
                summary["rows"].append(entry)

    placed = [r for r in kern["results"] if r["kind"] == "paged_decode" and "placement_stats" in r
              and r["layout"].startswith("paged")]
    if placed:
        lines += ["", "| placement statistics | placement | contiguous neighbours | ascending neighbours | mean run "
                  "(pages) | 2 MiB regions per sequence (fewest possible) | pool pages |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in placed:
            st = r["placement_stats"]
            lines.append(f"| {r['name']} | {r['placement']} | {100 * st['contiguous_pairs']:.1f}% | "
                         f"{100 * st['ascending_pairs']:.1f}% | {st['mean_run_pages']:.1f} | "
                         f"{st['regions_2mib_per_seq']:.0f} ({st['regions_2mib_per_seq_min']:.0f}) | "
                         f"{st['pool_pages']} |")

    sweep = [r for r in kern["results"] if r["kind"] == "paged_decode_split_sweep"]
    if sweep:
        lines += ["", "| split sweep (forced num_splits) | splits | time (us) | GB/s | % copy |", "|---|---:|---:|---:|---:|"]
        for r in sweep:
            lines.append(f"| {r['name']} | {r['num_splits']} | {r['median_us']:.1f} | {r['gb_per_s']:.0f} | "
                         f"{100 * r['ratio_to_copy']:.1f}% |")

    lines += ["", "| selection (one layer) | time (us) | bytes floor (us at copy BW) | time / floor |",
              "|---|---:|---:|---:|"]
    for r in kern["results"]:
        if r["kind"].startswith("selection_"):
            extra = f" ({r['per_layer_us']:.1f} us per layer)" if "per_layer_us" in r else ""
            lines.append(f"| {r['name']}{extra} | {r['median_us']:.1f} | {r['floor_us_at_copy_bw']:.1f} | "
                         f"{r['median_us'] / r['floor_us_at_copy_bw']:.2f} |")
    tot = [r for r in kern["results"] if r["kind"] == "selection_layer_total"]
    if tot:
        lines.append(f"| 36 layers (x36 of layer_total) | {36 * tot[0]['median_us']:.0f} | "
                     f"{36 * tot[0]['floor_us_at_copy_bw']:.0f} | |")

    lines += ["", "| prefill | ours (us) | ours TFLOP/s | SDPA default (us) | SDPA best (us, backend) | x SDPA best |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in kern["results"]:
        if r["kind"] == "prefill":
            T = r["shape"]["q_len"]
            p = peer.get(f"sdpa_prefill_bf16_B1_T{T}")
            if p is not None:
                lines.append(f"| {r['name']} | {r['median_us']:.1f} | {r['tflop_per_s']:.0f} | {p['median_us']:.1f} | "
                             f"{p['best_median_us']:.1f} ({p['best_backend']}) | "
                             f"{p['best_median_us'] / r['median_us']:.2f}x |")
            else:
                lines.append(f"| {r['name']} | {r['median_us']:.1f} | {r['tflop_per_s']:.0f} | | | |")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
