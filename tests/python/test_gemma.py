"""Gemma 3 270M (the real GGUF of scripts/fetch-gemma.sh, $KURA_GEMMA_MODEL) through `kura serve` and the
official `openai` client: it serves on the hybrid pool (5 of 6 layers slide over 512 tokens), a cached
prompt gives the cold prompt's tokens for prefixes shorter and longer than the window, and a prompt whose
window parts the pool reclaimed is told `window_dropped`.

The file is a base (pretrained) model: its chat answers are poor, so the tests check the API and the cache,
not the prose.
"""

import os

import httpx
import pytest

from conftest import EXACT, KuraServer, long_text


def gemma_path() -> str:
    p = os.environ.get("KURA_GEMMA_MODEL")
    assert p, "KURA_GEMMA_MODEL is not set: scripts/test.sh sets it from scripts/fetch-gemma.sh"
    assert os.path.isfile(p), f"Gemma 3 model missing at {p}: run scripts/fetch-gemma.sh"
    return p


@pytest.fixture(scope="module")
def gemma():
    s = KuraServer("--kv-cache-memory", "64MiB", "--max-model-len", "4096", *EXACT, model=gemma_path())
    yield s
    s.stop()


def test_gemma_serves_on_the_hybrid_pool(gemma):
    log = gemma.log()
    assert "hybrid pool of" in log, log
    assert "15 sliding layers" in log and "3 full-attention layers" in log, log
    m = gemma.metrics()
    assert m["kura:kv_pages_total"] == 64 * 1024 * 1024 // (16 * 256 * 2 * 2)
    c = gemma.client()
    r = c.chat.completions.create(
        model=gemma.model(),
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=12,
        temperature=0,
    )
    assert r.choices[0].message.content
    assert r.usage.completion_tokens == 12 or r.choices[0].finish_reason == "stop"
    # The chat template wrote Gemma's turn markers, tokenized as special tokens.
    assert r.usage.prompt_tokens < 30
    text = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=gemma.model(), prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
        if ch.choices
    )
    assert "Paris" in text or "France" in text, text
    # /tokenize counts a prompt as a completion does (Gemma adds BOS), or without it as vLLM's
    # add_special_tokens false asks.
    tok = lambda body: httpx.post(gemma.url + "/tokenize", json=body, timeout=60).json()  # noqa: E731
    with_bos = tok({"prompt": "The capital of France is"})["tokens"]
    bare = tok({"prompt": "The capital of France is", "add_special_tokens": False})["tokens"]
    assert with_bos == [2] + bare, (with_bos, bare)


@pytest.mark.parametrize("words", [60, 900])
def test_gemma_cached_prompts_give_the_cold_tokens_across_the_window(gemma, words):
    c = gemma.client()
    # A cache salt of the case's own: nothing another test cached is found.
    salt = f"case-{words}"
    prompt = long_text(words, seed=words)
    n = len(gemma.tokenize(prompt))
    # 60 words stay inside the 512-token window, 900 words go well past it.
    assert (n < 512) == (words == 60), n
    cold = c.completions.create(model=gemma.model(), prompt=prompt, max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True, "cache_salt": salt})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = c.completions.create(model=gemma.model(), prompt=prompt, max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True, "cache_salt": salt})
    assert warm.usage.prompt_tokens_details.cached_tokens >= (n - 1) // 16 * 16
    assert warm.choices[0].text == cold.choices[0].text
    # The same prompt with a new question after it hits the old prompt's blocks (and the window before its
    # end), and answers as a cold request under another cache salt.
    longer = prompt + " and then the river turned north"
    shared = c.completions.create(model=gemma.model(), prompt=longer, max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True, "cache_salt": salt})
    assert shared.usage.prompt_tokens_details.cached_tokens >= (n - 1) // 16 * 16
    alone = c.completions.create(
        model=gemma.model(), prompt=longer, max_tokens=16, temperature=0,
        extra_body={"cache_salt": salt + "-alone", "ignore_eos": True},
    )
    assert alone.usage.prompt_tokens_details.cached_tokens == 0
    assert shared.choices[0].text == alone.choices[0].text
    m = gemma.wait_idle()
    assert m["kura:kv_cache_blocks_used"] == 0


def test_gemma_structured_outputs_validate(gemma):
    """The fifty schemas of test_structured.py on Gemma 3's vocabulary of 262,144 tokens, every other one
    greedy and the rest at temperature 1 (test_structured.py runs each both ways on the default model):
    every output validates, and nine in ten end by themselves."""
    from test_structured import SCHEMAS, check_schema_runs, schema_runs

    check_schema_runs(schema_runs(gemma, plan=[(i, float(i % 2), 1) for i in range(len(SCHEMAS))]))


def test_a_prompt_whose_window_parts_were_reclaimed_is_told_window_dropped(gemma):
    """A long prompt, then others until the pool reclaims the idle window parts the first one left (a
    hybrid pool gives those back before whole blocks): the first prompt again finds its blocks without
    the parts its sliding layers read, is cut back, and is told `window_dropped`."""
    c = gemma.client()

    def send(prompt: str, salt: str):
        return c.completions.create(model=gemma.model(), prompt=prompt, max_tokens=1, temperature=0,
                                    extra_body={"cache_salt": salt})

    def dropped() -> float:
        return gemma.metrics().get('kura:prefix_cache_misses_total{reason="window_dropped"}', 0.0)

    first = long_text(1000, seed=501)
    before = dropped()
    assert send(first, "window-a").usage.prompt_tokens_details.cached_tokens == 0
    for i in range(7):
        send(long_text(1000, seed=600 + i), f"window-b{i}")
    m = gemma.metrics()
    assert m["kura:kv_window_part_drops_total"] > 0, "the pool never reclaimed a window part"
    again = send(first, "window-a").usage
    miss = again.prompt_tokens_details.model_extra.get("cache_miss") if again.prompt_tokens_details else None
    assert miss is not None and miss["reason"] == "window_dropped", (again, gemma.metrics())
    assert miss["at_token"] == again.prompt_tokens_details.cached_tokens
    assert dropped() == before + 1
