#!/usr/bin/env python3
"""Concurrency at long context on a model with sliding-window layers: the hybrid pool against whole-model
blocks, each against what `kura plan` predicts for the same flags.

For each pool (`hybrid`, then `whole` with --no-hybrid-pool) it asks `kura plan --json` how many requests of
CONTEXT tokens fit in POOL bytes of KV, starts `kura serve` with those flags, sends that many plus EXTRA
requests at once (distinct token-id prompts of CONTEXT - OUTPUT tokens, OUTPUT tokens each, ignore_eos,
through the OpenAI completions API), and samples `kura:num_requests_running` every 20 ms: the most requests
the server ran at once is what it admitted. Writes OUT/results.json and OUT/results.md.

    bench/hybrid-pool.py    (env: MODEL=<gguf> (default: scripts/fetch-gemma.sh) POOL=320MiB CONTEXT=8192
                             OUTPUT=16 EXTRA=2 THREADS=2 PORT=8021 OUT=bench-out/hybrid-pool
                             KURA_BIN=target/release/kura)

Only the standard library; the server is Kura's release build.
"""

import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POOL = os.environ.get("POOL", "320MiB")
CONTEXT = int(os.environ.get("CONTEXT", "8192"))
OUTPUT = int(os.environ.get("OUTPUT", "16"))
EXTRA = int(os.environ.get("EXTRA", "2"))
THREADS = os.environ.get("THREADS", "2")
PORT = int(os.environ.get("PORT", "8021"))
OUT = Path(os.environ.get("OUT", REPO / "bench-out" / "hybrid-pool"))
KURA = os.environ.get("KURA_BIN", str(REPO / "target" / "release" / "kura"))


def model_path():
    if os.environ.get("MODEL"):
        return os.environ["MODEL"]
    return subprocess.check_output([str(REPO / "scripts" / "fetch-gemma.sh")], text=True).strip()


def plan(model, flags):
    out = subprocess.check_output(
        [KURA, "plan", "--model", model, "--kv-cache-memory", POOL, "--context", str(CONTEXT), "--json"]
        + flags,
        text=True,
    )
    return json.loads(out)


def metric(url, name):
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def complete(url, prompt, results, i):
    body = json.dumps(
        {"model": "m", "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.time()
    try:
        r = json.loads(urllib.request.urlopen(req, timeout=3600).read())
        results[i] = {"ok": True, "completion_tokens": r["usage"]["completion_tokens"], "s": time.time() - t0}
    except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
        results[i] = {"ok": False, "error": str(e), "s": time.time() - t0}


def run(model, label, flags, predicted):
    log = open(OUT / f"serve-{label}.log", "w")
    server = subprocess.Popen(
        [KURA, "serve", "--model", model, "--host", "127.0.0.1", "--port", str(PORT), "--threads", THREADS,
         "--kv-cache-memory", POOL, "--max-model-len", str(CONTEXT), "--served-model-name", "m"] + flags,
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{PORT}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except Exception:  # noqa: BLE001 (not up yet)
                if server.poll() is not None:
                    sys.exit(f"kura serve exited; see {log.name}")
                time.sleep(0.5)
        n = predicted + EXTRA
        rng = random.Random(7)
        prompts = [[rng.randrange(1000, 200_000) for _ in range(CONTEXT - OUTPUT)] for _ in range(n)]
        results = [None] * n
        threads = [threading.Thread(target=complete, args=(url, p, results, i)) for i, p in enumerate(prompts)]
        t0 = time.time()
        for t in threads:
            t.start()
        most = 0
        while any(t.is_alive() for t in threads):
            most = max(most, int(metric(url, "kura:num_requests_running")))
            time.sleep(0.02)
        wall = time.time() - t0
        preemptions = metric(url, "kura:num_preemptions_total")
        return {
            "pool": label,
            "predicted": predicted,
            "requests": n,
            "max_running": most,
            "completed": sum(1 for r in results if r and r["ok"]),
            "preemptions": preemptions,
            "wall_s": round(wall, 1),
        }
    finally:
        server.terminate()
        server.wait()
        log.close()


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    model = model_path()
    load = open("/proc/loadavg").read().split()[0]
    rows = []
    for label, flags in [("hybrid", []), ("whole", ["--no-hybrid-pool"])]:
        p = plan(model, flags)
        row = run(model, label, flags, p["max_concurrency"])
        row["plan_pages_per_request"] = (p.get("hybrid_pool") or {}).get("pages_per_request")
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    report = {"model": model, "pool": POOL, "context": CONTEXT, "output": OUTPUT, "threads": THREADS,
              "load_at_start": load, "runs": rows}
    (OUT / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Concurrency at {CONTEXT} tokens, {POOL} of KV ({Path(model).name}, {THREADS} threads)",
        "",
        "| pool | kura plan predicts | requests sent | most running at once | completed | preemptions | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pool']} | {r['predicted']} | {r['requests']} | {r['max_running']} | {r['completed']} | "
            f"{r['preemptions']:.0f} | {r['wall_s']} |"
        )
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
