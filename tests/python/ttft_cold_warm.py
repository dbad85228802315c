"""Measures TTFT of the same long prompt sent twice (cold, then served from the prefix cache) against a
running `kura serve`, with the official `openai` client, streaming. Each trial uses a fresh prompt, so
its first request is truly cold.

    python tests/python/ttft_cold_warm.py --url http://127.0.0.1:8000 --words 700 --trials 5
"""

import argparse
import statistics
import time

import openai

from conftest import long_text


def ttft(client, model, prompt, max_tokens):
    t0 = time.perf_counter()
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    first = None
    text = ""
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter() - t0
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    return first, text, usage


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--words", type=int, default=700)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    colds, warms = [], []
    for trial in range(args.trials):
        prompt = long_text(args.words, seed=1000 + trial)
        cold, cold_text, cold_usage = ttft(client, model, prompt, args.max_tokens)
        warm, warm_text, warm_usage = ttft(client, model, prompt, args.max_tokens)
        if warm_text != cold_text:
            print(f"trial {trial}: greedy output differs between cold and warm")
        colds.append(cold)
        warms.append(warm)
        print(
            f"trial {trial}: prompt {cold_usage.prompt_tokens} tokens, cold TTFT {cold * 1000:.1f} ms "
            f"(cached {cold_usage.prompt_tokens_details.cached_tokens}), warm TTFT {warm * 1000:.1f} ms "
            f"(cached {warm_usage.prompt_tokens_details.cached_tokens}), ratio {cold / warm:.1f}x"
        )
    c, w = statistics.median(colds), statistics.median(warms)
    print(f"median cold TTFT {c * 1000:.1f} ms, warm {w * 1000:.1f} ms, ratio {c / w:.1f}x")


if __name__ == "__main__":
    main()
