"""Prefix reuse through the API: cached_tokens, equal greedy output, cache_salt and per-key tenants."""

import time

import anthropic
import httpx
import openai
import pytest

from conftest import BLOCK, EXACT, KuraServer, long_text


def test_same_long_prompt_twice_is_served_from_cache(server):
    client = server.client()
    prompt = long_text(700, seed=11)
    n = len(server.tokenize(prompt))
    kw = dict(model=server.model(), prompt=prompt, max_tokens=16, temperature=0)
    t0 = time.perf_counter()
    cold = client.completions.create(**kw)
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = client.completions.create(**kw)
    warm_s = time.perf_counter() - t0
    print(f"\nprompt {n} tokens: cold {cold_s * 1000:.0f} ms, warm {warm_s * 1000:.0f} ms")
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens >= (n - 1) // BLOCK * BLOCK
    assert warm.choices[0].text == cold.choices[0].text


def test_different_cache_salt_shares_nothing(server):
    client = server.client()
    prompt = long_text(300, seed=12)
    kw = dict(model=server.model(), prompt=prompt, max_tokens=2, temperature=0)
    first = client.completions.create(extra_body={"cache_salt": "tenant-a"}, **kw)
    other = client.completions.create(extra_body={"cache_salt": "tenant-b"}, **kw)
    same = client.completions.create(extra_body={"cache_salt": "tenant-a"}, **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens > 0


def test_cache_salt_keeps_anthropic_messages_apart(server):
    """`cache_salt` on /v1/messages (an extension, as on the OpenAI routes), through the official client:
    another salt reads nothing of the first's blocks, the same salt reads them."""
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kw = dict(model=server.model(), max_tokens=1,
              messages=[{"role": "user", "content": long_text(300, seed=14)}])
    first = client.messages.create(extra_body={"cache_salt": "messages-a"}, **kw).usage
    other = client.messages.create(extra_body={"cache_salt": "messages-b"}, **kw).usage
    same = client.messages.create(extra_body={"cache_salt": "messages-a"}, **kw).usage
    assert first.cache_read_input_tokens == 0, first
    assert other.cache_read_input_tokens == 0, other
    assert same.cache_read_input_tokens >= first.input_tokens - BLOCK, same
    for bad, says in (("", "must not be empty"), (5, "must be a string"), ("s" * 1025, "at most 1024")):
        with pytest.raises(anthropic.BadRequestError, match=says):
            client.messages.create(extra_body={"cache_salt": bad}, **kw)


def test_api_keys_are_tenants(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# tenants\nkey-two\n")
    s = KuraServer("--kv-cache-memory", "64MiB", *EXACT, "--api-key", "key-one", "--api-key-file", str(keys),
                   api_key="key-one")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        assert httpx.get(s.url + "/health").status_code == 200
        prompt = long_text(200, seed=13)
        kw = dict(model=s.model(), prompt=prompt, max_tokens=2, temperature=0)
        one = s.client("key-one")
        two = s.client("key-two")
        assert one.completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
        assert two.completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
        assert one.completions.create(**kw).usage.prompt_tokens_details.cached_tokens > 0
    finally:
        s.stop()


def test_no_prefix_cache_reuses_nothing():
    s = KuraServer("--kv-cache-memory", "64MiB", "--no-prefix-cache")
    try:
        kw = dict(model=s.model(), prompt=long_text(200, seed=14), max_tokens=2, temperature=0)
        for _ in range(2):
            assert s.client().completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
        m = s.metrics()
        assert m["kura:prefix_cache_hits_total"] == 0
        assert m["kura:prompt_tokens_computed_total"] == m["kura:prompt_tokens_total"]
    finally:
        s.stop()
