#!/usr/bin/env python3
"""KV-aware routing against round-robin and least-load on a local fleet (bench/fleet.sh runs this).

For each policy a fresh fleet is started with scripts/fleet.sh (REPLICAS replicas of `kura serve
--kv-events`, THREADS threads each, `kura router --policy P` in front), then `kura bench` runs the
shared-prefix and multi-turn workloads through the router, one run each. Each replica's pool is sized so
that the workload's prefixes fit in the fleet's pools together but not in one replica's: round-robin
sends every prefix to every replica and evicts them, the kv policy keeps each on one replica.

Reported per policy and workload: cached prompt tokens (the replicas' `usage`), TTFT p50 and p90, ITL p50,
output tokens/s; the router's predicted and reported cached tokens. Results as JSON and a Markdown table.
"""

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]


def metrics(url: str) -> dict[str, float]:
    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
    return out


def wait_up(url: str, proc: subprocess.Popen, logs: pathlib.Path):
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"fleet.sh exited; logs in {logs}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    # Every replica's first KV snapshot.
                    m = metrics(url)
                    snaps = [v for k, v in m.items() if k.startswith("kura_router:kv_snapshots_total")]
                    if snaps and all(v >= 1 for v in snaps):
                        return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"the fleet did not come up; logs in {logs}")


def run_policy(args, policy: str, workload: list[str], out: pathlib.Path) -> dict:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, KURA_BIN=args.kura, KURA_MODEL=args.model, REPLICAS=str(args.replicas),
               THREADS=str(args.threads), POLICY=policy, PORT=str(args.port), LOGS=str(logs))
    fleet = subprocess.Popen([str(ROOT / "scripts" / "fleet.sh"), "--", "--kv-cache-memory", args.kv_cache_memory],
                             env=env, stdout=subprocess.DEVNULL, stderr=open(logs / "fleet.log", "w"))
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_up(url, fleet, logs)
        subprocess.run([args.kura, "bench", *workload, "--url", url, "--out", str(out), "-q"], check=True)
        m = metrics(url)
    finally:
        fleet.send_signal(signal.SIGTERM)
        fleet.wait(60)
    s = json.loads((out / "run.json").read_text())["points"][0]["summary"]
    total = lambda prefix: sum(v for k, v in m.items() if k.startswith(prefix))
    return {
        "policy": policy,
        "requests": s["requests"],
        "failed": s["failed"],
        "prompt_tokens": s["prompt_tokens"],
        "cached_tokens": s["cached_tokens"],
        "cached_ratio": s["cached_token_ratio"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p90_ms": s["ttft_ms"]["p90"],
        "itl_p50_ms": s["itl_ms"]["p50"],
        "output_tok_per_s": s["output_tok_per_s"],
        "router_predicted_cached": total("kura_router:predicted_cached_tokens_total"),
        "router_reported_cached": total("kura_router:reported_cached_tokens_total"),
        "routed": {k.split('"')[1]: v for k, v in m.items() if k.startswith("kura_router:requests_total")},
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kura", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--port", type=int, default=8600)
    p.add_argument("--policies", default="kv,round-robin,least-load")
    p.add_argument("--out", default="bench-fleet")
    p.add_argument("--workloads", default="shared-prefix,multi-turn")
    a = p.parse_args()
    out = pathlib.Path(a.out)
    # Sized by the fleet: 4 shared prefixes, or 2 conversations, per replica, so that kv routing can keep
    # each replica's share in its pool while every replica would need all of them under round-robin.
    r = a.replicas
    workloads = {
        "shared-prefix": ["shared-prefix", "--groups", str(4 * r), "--users-per-group", "6", "--system-tokens",
                          "512", "--question-tokens", "32", "--output-tokens", "16", "--concurrency", str(2 * r)],
        # Chat as applications send it: a long system prompt, short user turns.
        "multi-turn": ["multi-turn", "--conversations", str(2 * r), "--turns", "4", "--system-tokens", "1000",
                       "--user-tokens", "50", "--output-tokens", "16", "--concurrency", str(2 * r)],
    }
    results = []
    for name in a.workloads.split(","):
        workload = workloads[name]
        for policy in a.policies.split(","):
            r = run_policy(a, policy, workload, out / name / policy)
            r["workload"] = name
            results.append(r)
            print(json.dumps(r), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = ["| workload | policy | requests (failed) | cached tokens | cached ratio | TTFT p50 ms | TTFT p90 ms | "
             "ITL p50 ms | output tok/s | router predicted / reported cached |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['workload']} | {r['policy']} | {r['requests']} ({r['failed']}) | {r['cached_tokens']} | "
                     f"{r['cached_ratio']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | {r['itl_p50_ms']:.1f} | "
                     f"{r['output_tok_per_s']:.1f} | {r['router_predicted_cached']:.0f} / {r['router_reported_cached']:.0f} |")
    table = "\n".join(lines)
    (out / "summary.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
