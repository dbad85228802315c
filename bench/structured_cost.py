#!/usr/bin/env python3
"""The cost of structured outputs on decode: eight requests at once (a batch of eight), every one
constrained by a JSON schema, against the same eight unconstrained, interleaved in one run against one
`kura serve`. Reports the engine's mean step time and decode tokens/s from its /metrics, per mode
(median of the runs) and their ratio to the unconstrained one.

    python3 bench/structured_cost.py --url http://127.0.0.1:8000 [--runs 3] [--tokens 128]

Two schemas. `open`: an array of at least 500 bounded integers, so that no constrained choice can end
before `--tokens` (nor be closed: its grammar cannot end within the budget, and the walk stops looking
after a failed look for a while). `closing`: an object holding an array of bounded integers, which the
model fills until the budget runs short, and which the walk then closes (`]}`): the mode in which
every step near the end of the budget is checked. `ignore_eos` keeps the unconstrained choices going
as long.
"""

import argparse
import concurrent.futures as cf
import statistics
import time

import httpx

from server_metrics import mean_step_ms, metrics

NUMBER = {"type": "integer", "minimum": 0, "maximum": 1000}
SCHEMAS = {
    "free": None,
    "open": {"type": "array", "items": NUMBER, "minItems": 500},
    "closing": {"type": "object", "properties": {"numbers": {"type": "array", "items": NUMBER}},
                "required": ["numbers"], "additionalProperties": False},
}


def run(url: str, model: str, mode: str, tokens: int, batch: int) -> dict[str, float]:
    body = {"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "List many numbers as a JSON array."}]}
    if SCHEMAS[mode] is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "numbers", "schema": SCHEMAS[mode]}}

    def one(i: int) -> int:
        r = httpx.post(url + "/v1/chat/completions", json={**body, "seed": i}, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    before = metrics(url)
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(batch) as ex:
        generated = sum(ex.map(one, range(batch)))
    wall = time.perf_counter() - start
    _, step_ms = mean_step_ms(before, metrics(url))
    return {"generated": generated, "wall_s": wall, "step_ms": step_ms, "tokens_per_s": generated / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args()
    model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
    run(a.url, model, "open", 8, a.batch)  # builds the vocabulary's token trie once, outside the runs
    results: dict[str, list[dict]] = {mode: [] for mode in SCHEMAS}
    for _ in range(a.runs):
        for mode in SCHEMAS:
            results[mode].append(run(a.url, model, mode, a.tokens, a.batch))
    med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in results.items()}
    for mode, m in med.items():
        print(f"{mode:8} step {m['step_ms']:.2f} ms  decode {m['tokens_per_s']:.1f} tok/s"
              f"  ({m['generated']:.0f} tokens, {a.runs} runs, median)")
    for mode in ("open", "closing"):
        print(f"{mode}/free step time: {med[mode]['step_ms'] / med['free']['step_ms']:.3f}; "
              f"tokens/s: {med[mode]['tokens_per_s'] / med['free']['tokens_per_s']:.3f}")


if __name__ == "__main__":
    main()
