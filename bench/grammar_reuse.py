#!/usr/bin/env python3
"""What a kept grammar saves an agent's turn: one chat request at a time with N strict function tools
(a grammar compiled for the first request, then kept for the tenant's next ones with the same tools)
against the same tools with `strict: false` (no grammar), interleaved in one run against one
`kura serve`, `max_tokens` 1 so that the time is mostly the prompt's (cached after the first request)
and the grammar's. Prints the medians of the runs after the first, in ms, and the compiles and reuses
the server counted.

    python3 bench/grammar_reuse.py --url http://127.0.0.1:8000 [--runs 7] [--tools 1 8 32]
"""

import argparse
import copy
import statistics
import time

import httpx

from server_metrics import metrics


def tool(i: int) -> dict:
    """A tool with a schema of the size agents send: strings, an enum, bounded numbers, a list of
    objects with a union inside."""
    item = {"type": "object", "additionalProperties": False, "required": ["field", "op", "value"],
            "properties": {"field": {"type": "string"}, "op": {"enum": ["eq", "lt", "gt"]},
                           "value": {"anyOf": [{"type": "string"}, {"type": "number"}]}}}
    return {"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool number {i} does a thing with records.", "strict": True,
        "parameters": {"type": "object", "additionalProperties": False,
                       "required": ["query", "limit", "filters", "mode"],
                       "properties": {"query": {"type": "string", "maxLength": 200},
                                      "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                                      "mode": {"type": "string", "enum": ["fast", "exact", "fuzzy"]},
                                      "filters": {"type": "array", "maxItems": 8, "items": item}}}}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--tools", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    for n in args.tools:
        strict = [tool(i) for i in range(n)]
        loose = copy.deepcopy(strict)
        for t in loose:
            t["function"]["strict"] = False
        times: dict[str, list[float]] = {"strict": [], "loose": []}
        before = metrics(args.url)
        for run in range(args.runs):
            for name, tools in (("strict", strict), ("loose", loose)):
                body = {"model": model, "messages": [{"role": "user", "content": "Find records."}],
                        "tools": tools, "max_tokens": 1, "temperature": 0}
                t0 = time.perf_counter()
                r = httpx.post(args.url + "/v1/chat/completions", json=body, timeout=300)
                elapsed = (time.perf_counter() - t0) * 1000
                r.raise_for_status()
                if run > 0:
                    times[name].append(elapsed)
        after = metrics(args.url)
        counted = {k: after.get(k, 0) - before.get(k, 0)
                   for k in ("kura:grammar_compiles_total", "kura:grammar_reuses_total")}
        print(f"{n} tools: strict {statistics.median(times['strict']):.1f} ms, "
              f"loose {statistics.median(times['loose']):.1f} ms (medians of {args.runs - 1}); "
              f"compiled {counted['kura:grammar_compiles_total']:.0f}, "
              f"reused {counted['kura:grammar_reuses_total']:.0f}", flush=True)


if __name__ == "__main__":
    main()
