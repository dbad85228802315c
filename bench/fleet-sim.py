#!/usr/bin/env python3
"""The fleet simulated on the Mooncake conversation trace (bench/fleet-sim.sh runs this).

Three parts, each a `kura sim --workload trace --replicas … --router … --json` run on the whole trace
(12,031 requests), with the engine's scheduler per replica and the cost model in data/cost/:

1. Hit ratio, TTFT and throughput per policy for 4 to 64 replicas: prompts cut to 4,096 tokens and
   outputs to 64 (the simulated model's context), arrivals 10 times slower than the trace (a CPU
   replica is slower than the GPUs it was recorded on), 4,096 blocks per replica.
2. The infinite-cache end: whole prompts, pools of 262,144 blocks (4 M tokens) per replica, arrivals
   1,000 times slower (whole prompts of up to 100 k tokens take the CPU cost model minutes each, and a
   queue that grows without end admits a conversation's next turn before its last one is computed),
   against the trace's own figure for one unbounded cache (37.4 % of prompt tokens, Mooncake's
   conversation trace).
3. The cache a fleet needs: 16 replicas of 4,096 blocks with a shared tier (Redis, L4) of 0 to 4 M
   blocks, round-robin and kv.

Writes results.json, summary.md and hit-ratio.svg (hit ratio against replicas, one line per policy).
"""

import argparse
import json
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def sim(kura: str, *args: str) -> list[dict]:
    out = subprocess.run(
        [kura, "sim", "--workload", "trace", "--trace", str(ROOT / "data/traces/mooncake_conversation_trace.jsonl"),
         "--json", *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out)["fleets"]


def svg(points: dict[str, list[tuple[int, float]]], path: pathlib.Path, reference: float):
    w, h, left, bottom, top, right = 640, 400, 60, 50, 20, 140
    xs = sorted({x for p in points.values() for x, _ in p})
    import math
    lx = lambda x: left + (math.log2(x) - math.log2(xs[0])) / max(1e-9, math.log2(xs[-1]) - math.log2(xs[0])) * (w - left - right)
    ly = lambda y: h - bottom - y / 0.5 * (h - bottom - top)
    colors = {"kv": "#1f77b4", "round-robin": "#d62728", "least-load": "#2ca02c"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>']
    for x in xs:
        parts.append(f'<text x="{lx(x)}" y="{h - bottom + 16}" text-anchor="middle">{x}</text>')
    for y in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5):
        parts.append(f'<text x="{left - 6}" y="{ly(y) + 4}" text-anchor="end">{y:.0%}</text>')
        parts.append(f'<line x1="{left}" y1="{ly(y)}" x2="{w - right}" y2="{ly(y)}" stroke="#ddd"/>')
    parts.append(f'<line x1="{left}" y1="{ly(reference)}" x2="{w - right}" y2="{ly(reference)}" stroke="#888" stroke-dasharray="4 3"/>')
    parts.append(f'<text x="{w - right + 4}" y="{ly(reference) + 4}" fill="#555">one unbounded cache</text>')
    for i, (policy, p) in enumerate(points.items()):
        c = colors.get(policy, "black")
        pts = " ".join(f"{lx(x)},{ly(y)}" for x, y in p)
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        for x, y in p:
            parts.append(f'<circle cx="{lx(x)}" cy="{ly(y)}" r="3" fill="{c}"/>')
        parts.append(f'<text x="{w - right + 4}" y="{top + 16 * i + 10}" fill="{c}">{policy}</text>')
    parts.append(f'<text x="{(left + w - right) / 2}" y="{h - 10}" text-anchor="middle">replicas (4,096 blocks each)</text>')
    parts.append(f'<text x="14" y="{(top + h - bottom) / 2}" transform="rotate(-90 14 {(top + h - bottom) / 2})" text-anchor="middle">prompt tokens cached</text>')
    parts.append('</svg>')
    path.write_text("\n".join(parts) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kura", required=True)
    p.add_argument("--out", default="bench-fleet-sim")
    a = p.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shaped = ["--time-scale", "10", "--max-prompt-tokens", "4096", "--max-output-tokens", "64", "--kv-blocks", "4096"]
    sweep = sim(a.kura, *shaped, "--replicas", "4,8,16,32,64", "--router", "kv,round-robin,least-load")
    infinite = sim(a.kura, "--time-scale", "1000", "--max-model-len", "1000000", "--max-output-tokens", "64",
                   "--kv-blocks", "262144", "--replicas", "1,4,16", "--router", "kv,round-robin")
    shared = sim(a.kura, *shaped, "--replicas", "16", "--router", "round-robin,kv",
                 "--l4-blocks", "0,16384,65536,262144,4194304")
    results = {"sweep": sweep, "infinite": infinite, "shared_tier": shared}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    row = lambda r: (f"| {r['replicas']} | {r['policy']} | {r['l4_blocks'] or 0} | {r['cached_ratio']:.1%} | "
                     f"{r['l4_ratio']:.1%} | {r['ttft_ms']['mean'] / 1e3:.1f} | {r['ttft_ms']['p50'] / 1e3:.1f} | "
                     f"{r['ttft_ms']['p99'] / 1e3:.1f} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['max_replica_requests']} / {r['min_replica_requests']} |")
    head = ("| replicas | router | L4 blocks | cached | from L4 | TTFT mean s | TTFT p50 s | TTFT p99 s | out tok/s | "
            "requests per replica (max / min) |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    md = ["## 1. Policies against fleet size (prompts cut to 4,096 tokens, arrivals ×10 slower, 4,096 blocks per replica)",
          "", head, *map(row, sweep), "",
          "## 2. The infinite-cache end (whole prompts, arrivals ×1000 slower, 262,144 blocks per replica; one unbounded cache: 37.4 %)",
          "", head, *map(row, infinite), "",
          "## 3. A shared tier (16 replicas as in 1, L4 of 0 to 4 M blocks)", "", head, *map(row, shared), ""]
    (out / "summary.md").write_text("\n".join(md))
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in sweep:
        lines.setdefault(r["policy"], []).append((r["replicas"], r["cached_ratio"]))
    svg(lines, out / "hit-ratio.svg", 0.374)
    print("\n".join(md))


if __name__ == "__main__":
    main()
