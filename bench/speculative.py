#!/usr/bin/env python3
"""Speculative decoding by n-gram lookup against decoding one token a step, in one run on one machine:
for each thread count, two `kura serve` on the same model (one with `--speculative-config`), the same
greedy requests sent to each in turn, streamed. Reports per task the median decode rate (tokens after
the first, over the time from the first token to the last), the ratio drafting / plain, the share of
draft tokens kept, and checks that both servers wrote the same text.

    python3 bench/speculative.py [--kura target/release/kura] [--model PATH] [--threads 1,2] [--runs 5]
        [--config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}']
        [--concurrency N]

With `--concurrency N` each run sends N requests of the task at once (each its own cache salt) and the rate is
theirs together: their tokens after each one's first, over the time from the first of those to the last.

Tasks: `copy` (a completion that goes on copying a paragraph), `edit` (a function with one name changed), `free` (a story: little
repeats, so drafts are mostly given back: the cost of drafting where it does not help).
"""

import argparse
import concurrent.futures
import json
import os
import pathlib
import socket
import statistics
import subprocess
import time
import uuid

import httpx

REPO = pathlib.Path(__file__).resolve().parents[1]
PARAGRAPH = ("Kura keeps the KV cache of every prompt in paged blocks, finds the prefixes that prompts share, "
             "and moves blocks between device memory, host memory, disk and Redis as the load changes. A block "
             "is served from a lower tier only after its hash, parent, key and tokens match.")
CODE = '''def load_blocks(path, block_size):
    blocks = []
    with open(path, "rb") as f:
        while True:
            data = f.read(block_size)
            if not data:
                break
            blocks.append(data)
    return blocks
'''
# (route, prompt): `copy` continues a text that repeats a paragraph (a completion), the others are chats.
TASKS = {
    "copy": ("completions", "Notes, first draft:\n" + PARAGRAPH + "\n\nNotes, final copy:\n" + PARAGRAPH[:30]),
    "edit": ("chat/completions", "Rewrite this Python function with the variable `blocks` renamed to `chunks`, "
             "and nothing else changed:\n" + CODE),
    "free": ("chat/completions", "Write a short story about a lighthouse keeper who finds a map."),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kura: str, model: str, threads: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([kura, "serve", "--model", model, "--port", str(port), "--threads", str(threads),
                             "--kv-cache-memory", "256MiB", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kura serve {' '.join(extra)} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # poll interval while the server starts
    proc.kill()
    raise SystemExit("kura serve did not start")


def spec_metrics(url: str) -> tuple[float, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kura:spec_decode_num_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return (out.get("kura:spec_decode_num_draft_tokens_total", 0.0),
            out.get("kura:spec_decode_num_accepted_tokens_total", 0.0))


def decode(url: str, model: str, task: tuple[str, str], max_tokens: int) -> tuple[float, int, str]:
    """Decode rate (tokens/s after the first), completion tokens, text; a fresh cache salt each time."""
    route, prompt = task
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_salt": uuid.uuid4().hex}
    if route == "completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    first = last = None
    text, tokens = "", 0
    with httpx.stream("POST", f"{url}/v1/{route}", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", []):
                piece = c.get("text") or c.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text += piece
    return (tokens - 1) / (last - first), tokens, text, first, last


def decode_together(url: str, model: str, task: tuple[str, str], max_tokens: int, n: int) -> tuple[float, int, str]:
    """`decode` of `n` requests at once: their decode rate together, the first one's tokens and text."""
    if n == 1:
        return decode(url, model, task, max_tokens)[:3]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        done = list(pool.map(lambda _: decode(url, model, task, max_tokens), range(n)))
    span = max(d[4] for d in done) - min(d[3] for d in done)
    return sum(d[1] - 1 for d in done) / span, done[0][1], done[0][2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kura", default=os.environ.get("KURA_BIN", str(REPO / "target/release/kura")))
    ap.add_argument("--model", default=os.environ.get("KURA_MODEL"))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--config", default=json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}))
    a = ap.parse_args()
    model = a.model or subprocess.run([str(REPO / "scripts/fetch-model.sh")], capture_output=True, text=True,
                                      check=True).stdout.strip()
    if a.concurrency < 1:
        raise SystemExit(f"--concurrency must be at least 1, got {a.concurrency}")
    print(f"speculative config: {a.config}; {a.runs} runs each, interleaved; {a.concurrency} request(s) at once; "
          "medians\n")
    print("| threads | task | tokens | plain tok/s | drafting tok/s | ratio | draft tokens kept | same text |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for threads in [int(t) for t in a.threads.split(",")]:
        plain, plain_url = start(a.kura, model, threads, [])
        spec, spec_url = start(a.kura, model, threads, ["--speculative-config", a.config])
        try:
            name = httpx.get(plain_url + "/v1/models", timeout=10).json()["data"][0]["id"]
            for task, spec_of in TASKS.items():
                rates = {"plain": [], "spec": []}
                texts, counts = {}, {}
                d0, k0 = spec_metrics(spec_url)
                for _ in range(a.runs):
                    for mode, url in (("plain", plain_url), ("spec", spec_url)):
                        rate, tokens, text = decode_together(url, name, spec_of, a.max_tokens, a.concurrency)
                        rates[mode].append(rate)
                        texts[mode], counts[mode] = text, tokens
                d1, k1 = spec_metrics(spec_url)
                p, s = statistics.median(rates["plain"]), statistics.median(rates["spec"])
                kept = (k1 - k0) / (d1 - d0) if d1 > d0 else 0.0
                print(f"| {threads} | {task} | {counts['spec']} | {p:.0f} | {s:.0f} | {s / p:.2f}× | "
                      f"{kept:.0%} | {'yes' if texts['plain'] == texts['spec'] else 'NO'} |", flush=True)
        finally:
            for proc in (plain, spec):
                proc.terminate()
                proc.wait()


if __name__ == "__main__":
    main()
