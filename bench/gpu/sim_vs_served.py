#!/usr/bin/env python3
"""`kura sim`'s prediction of a run against the run itself, side by side: TTFT p50 and p99, ITL p50 and
output tokens/s, each as simulated / measured (their ratio), and the share of prompt tokens cached.

    python3 bench/gpu/sim_vs_served.py SIM_JSON RUN_JSON

SIM_JSON: `kura sim --workload W ... --json`; RUN_JSON: the run.json that `kura bench W --out DIR` writes,
for the same workload, concurrency and pool. Points are paired in order (one per concurrency)."""
import json
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        sim = json.load(open(sys.argv[1]))["points"]
        run = json.load(open(sys.argv[2]))["points"]
    except (OSError, ValueError, KeyError) as e:
        print(f"sim_vs_served: cannot read the two reports: {e}", file=sys.stderr)
        return 1
    if len(sim) != len(run) or not sim:
        print(f"sim_vs_served: {len(sim)} simulated points against {len(run)} measured", file=sys.stderr)
        return 1
    print("| clients | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | out tok/s | cached |")
    print("|---:|---:|---:|---:|---:|---:|")
    for s, r in zip(sim, run):
        m = r["summary"]
        if not m.get("ttft_ms") or not m.get("itl_ms"):
            print(f"sim_vs_served: the measured run has no TTFT or ITL (no request succeeded?): {m}",
                  file=sys.stderr)
            return 1
        pairs = [(s["ttft_ms"]["p50"], m["ttft_ms"]["p50"]), (s["ttft_ms"]["p99"], m["ttft_ms"]["p99"]),
                 (s["itl_ms"]["p50"], m["itl_ms"]["p50"]), (s["output_tokens_per_s"], m["output_tok_per_s"])]
        cells = [f"{a:,.1f} / {b:,.1f} ({a / b:.2f})" if b else f"{a:,.1f} / –" for a, b in pairs]
        cached = f"{s['cached_ratio'] * 100:.1f} % / {(m.get('cached_token_ratio') or 0) * 100:.1f} %"
        print(f"| {r['load'].get('concurrency')} | " + " | ".join(cells) + f" | {cached} |")
    print("(each cell: simulated / measured (ratio))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
