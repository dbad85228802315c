"""Why a prompt missed the cache, through the official clients against a real `kura serve`: each reason
Kura reports (never_seen, evicted, diverged, template_rerendered, salt_differs) is produced on purpose,
read from the response's usage (`prompt_tokens_details.cache_miss`, Anthropic's `usage.cache_miss`,
Responses' `input_tokens_details.cache_miss`) and counted in `kura:prefix_cache_misses_total{reason}`.
The sixth, window_dropped, needs a model with a sliding window: test_gemma.py produces it; the seventh,
prompt_logprobs (a prompt scored by `echo` with `logprobs`), test_echo.py.
"""

import httpx
import pytest

from conftest import BLOCK, KuraServer, long_text


KEY = "sk-cache-miss-tenant"


@pytest.fixture(scope="module")
def server():
    # A small pool (about 45 blocks), so that a few prompts evict another; a key, so that a salt is the
    # key's own (without keys each salt is a tenant of its own, and nothing is told across salts).
    s = KuraServer("--api-key", KEY, "--kv-cache-memory", "16MiB", "--max-model-len", "2048", api_key=KEY)
    yield s
    s.stop()


def miss_counts(server: KuraServer) -> dict[str, float]:
    m = server.metrics()
    return {r: m.get(f'kura:prefix_cache_misses_total{{reason="{r}"}}', 0.0)
            for r in ("never_seen", "evicted", "diverged", "template_rerendered", "salt_differs", "window_dropped")}


def complete(server: KuraServer, prompt: str, **extra) -> dict:
    r = httpx.post(server.url + "/v1/completions", headers=server.headers(), timeout=120,
                   json={"model": server.model(), "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
    r.raise_for_status()
    return r.json()["usage"]


def check(server, before, reason, usage_miss):
    assert usage_miss is not None and usage_miss["reason"] == reason, usage_miss
    after = miss_counts(server)
    assert after[reason] == before[reason] + 1, (reason, before, after)


def test_never_seen_then_cached_then_salt_differs(server):
    prompt = long_text(120, seed=1)
    before = miss_counts(server)
    u = complete(server, prompt)
    check(server, before, "never_seen", u["prompt_tokens_details"].get("cache_miss"))
    assert u["prompt_tokens_details"]["cache_miss"]["at_token"] == 0
    # Cached as far as a prompt can be: no miss told.
    u = complete(server, prompt)
    assert u["prompt_tokens_details"]["cached_tokens"] >= (u["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert "cache_miss" not in u["prompt_tokens_details"], u
    # The same prompt under another salt of the same key.
    before = miss_counts(server)
    u = complete(server, prompt, cache_salt="another-salt")
    check(server, before, "salt_differs", u["prompt_tokens_details"].get("cache_miss"))


def test_diverged_at_the_first_differing_token(server):
    base = long_text(100, seed=2)
    # Tails of several blocks each, so that the prompt could have been cached past the divergence.
    a, b = base + " " + long_text(40, seed=20), base + " " + long_text(40, seed=21)
    complete(server, a)
    before = miss_counts(server)
    u = complete(server, b)
    miss = u["prompt_tokens_details"].get("cache_miss")
    check(server, before, "diverged", miss)
    ta, tb = server.tokenize(a), server.tokenize(b)
    first = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
    assert miss["at_token"] == first, (miss, first)
    # Whole blocks up to the divergence, and the block it falls in up to it (partial reuse by copy).
    assert first // BLOCK * BLOCK <= u["prompt_tokens_details"]["cached_tokens"] <= first


def test_evicted_when_other_prompts_took_its_blocks(server):
    victim = long_text(150, seed=3)
    complete(server, victim)
    # Enough other prompts to fill the small pool several times over.
    for seed in range(10, 16):
        complete(server, long_text(150, seed=seed))
    before = miss_counts(server)
    u = complete(server, victim)
    check(server, before, "evicted", u["prompt_tokens_details"].get("cache_miss"))


def test_template_rerendered_when_an_earlier_turn_comes_back_different(server):
    c = server.client()
    model = server.model()
    msgs = [{"role": "system", "content": long_text(80, seed=4)}, {"role": "user", "content": "Name a river."}]
    first = c.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
    answer = first.choices[0].message.content
    # The client sends the earlier answer back changed (as a template that rewrites history would).
    msgs += [{"role": "assistant", "content": "Well. " + answer}, {"role": "user", "content": "And a lake?"}]
    before = miss_counts(server)
    second = c.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
    miss = second.usage.prompt_tokens_details.model_extra.get("cache_miss")
    check(server, before, "template_rerendered", miss)
    assert miss["at_token"] < second.usage.prompt_tokens
    # Sent back as it was, the next turn is not told a re-render.
    msgs[2]["content"] = answer
    third = c.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
    m3 = third.usage.prompt_tokens_details.model_extra.get("cache_miss")
    assert m3 is None or m3["reason"] != "template_rerendered", m3


def test_anthropic_and_responses_tell_the_reason_too(server):
    prompt = long_text(90, seed=7)
    r = httpx.post(server.url + "/v1/messages", headers=server.headers(), timeout=120, json={
        "model": server.model(), "max_tokens": 1, "messages": [{"role": "user", "content": prompt}]})
    # The template's own opening was seen before (other chats of this module): the prompt diverged after it.
    miss = r.json()["usage"]["cache_miss"]
    assert miss["reason"] == "diverged" and 0 < miss["at_token"] < 30, miss
    r = httpx.post(server.url + "/v1/responses", headers=server.headers(), timeout=120, json={
        "model": server.model(), "max_output_tokens": 1, "input": long_text(90, seed=8), "store": False})
    miss = r.json()["usage"]["input_tokens_details"]["cache_miss"]
    assert miss["reason"] == "diverged" and 0 < miss["at_token"] < 30, miss
