#!/usr/bin/env python3
"""The cost of scoring a prompt (`echo` with `logprobs` on /v1/completions, as lm-evaluation-harness's
log-likelihood tasks ask it): the same prompt computed cold with one token generated, against scored
(`echo`, `logprobs` 1, `max_tokens` 0), interleaved in one run against one `kura serve`. Every request
carries a fresh `cache_salt`, so that neither reads the other's cached blocks. Reports each mode's median
time per prompt length and the ratio scored / plain.

    python3 bench/echo_cost.py --url http://127.0.0.1:8000 [--runs 5] [--tokens 256,1024]

Scoring computes the output head on every position (its rows of logits, then each token's log-softmax
and top alternatives), where a plain prefill computes it on the last position alone.
"""

import argparse
import statistics
import time
import uuid

import httpx

WORDS = ["river", "stone", "lantern", "harbor", "meadow", "copper", "willow", "signal", "orchard", "canyon"]


def prompt_of(url: str, model: str, tokens: int) -> list[int]:
    """About `tokens` tokens of filler text, as token ids cut to exactly `tokens`."""
    text = " ".join(WORDS[(i * 7 + i * i % 11) % len(WORDS)] for i in range(tokens))
    ids = httpx.post(url + "/tokenize", json={"model": model, "prompt": text}, timeout=60).json()["tokens"]
    assert len(ids) >= tokens, (len(ids), tokens)
    return ids[:tokens]


def timed(url: str, body: dict) -> float:
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={**body, "cache_salt": uuid.uuid4().hex}, timeout=600)
    r.raise_for_status()
    took = time.perf_counter() - t
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", default="256,1024")
    a = p.parse_args()
    model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
    print("| prompt tokens | plain (prefill + 1 token), ms | scored (echo, logprobs 1), ms | scored / plain |")
    print("|---:|---:|---:|---:|")
    for n in [int(x) for x in a.tokens.split(",")]:
        prompt = prompt_of(a.url, model, n)
        plain = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        scored = {"model": model, "prompt": prompt, "max_tokens": 0, "temperature": 0, "echo": True,
                  "logprobs": 1}
        timed(a.url, plain)  # warm-up
        times = {"plain": [], "scored": []}
        for _ in range(a.runs):
            times["plain"].append(timed(a.url, plain))
            times["scored"].append(timed(a.url, scored))
        p_ms, s_ms = (statistics.median(times[k]) * 1e3 for k in ("plain", "scored"))
        print(f"| {n:,} | {p_ms:.0f} | {s_ms:.0f} | {s_ms / p_ms:.2f}× |")


if __name__ == "__main__":
    main()
