"""Speculative decoding by n-gram lookup (`--speculative-config`) through the real server and the official
`openai` client: a server that drafts gives the same tokens and log-probabilities as one that decodes one
token a step, greedy and seeded, with penalties, several choices, stop strings, a JSON schema and streaming,
while its steps keep drafted tokens (`kura:spec_decode_*`) and take fewer forward steps where text repeats.
Bad configurations are refused at start with a message that names the problem.
"""

import json
import subprocess

import pytest

from conftest import KuraServer, kura_bin, model_path

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4})
DOC = ("Kura keeps the KV cache of every prompt in paged blocks, finds the prefixes that prompts share, "
       "and moves blocks between device memory, host memory, disk and Redis as the load changes. ") * 2
REPEAT = [{"role": "user", "content": "Repeat this text exactly, word for word:\n" + DOC}]


@pytest.fixture(scope="module")
def servers():
    plain = KuraServer("--threads", "1", "--kv-cache-memory", "256MiB")
    try:
        spec = KuraServer("--threads", "1", "--kv-cache-memory", "256MiB", "--speculative-config", SPEC)
    except BaseException:
        plain.stop()
        raise
    try:
        yield plain, spec
    finally:
        spec.stop()
        plain.stop()


def spec_counts(server: KuraServer) -> tuple[float, float, float, float]:
    m = server.metrics()
    return (m["kura:spec_decode_num_drafts_total"], m["kura:spec_decode_num_draft_tokens_total"],
            m["kura:spec_decode_num_accepted_tokens_total"], m["kura:engine_steps_total"])


def chat(server: KuraServer, **kw):
    return server.client().chat.completions.create(model=server.model(), **kw)


def same_choices(a, b):
    """Text, finish reason and every token's log-probabilities (as the server wrote them) of each choice."""
    def view(r):
        return [(c.message.content, c.finish_reason, c.logprobs and c.logprobs.model_dump()) for c in r.choices]
    assert view(a) == view(b)
    assert a.usage.completion_tokens == b.usage.completion_tokens


def test_greedy_repeated_text_takes_fewer_steps_with_the_same_tokens(servers):
    plain, spec = servers
    plain.wait_idle()
    spec.wait_idle()
    p0, s0 = spec_counts(plain), spec_counts(spec)
    a = chat(plain, messages=REPEAT, max_tokens=120, temperature=0, logprobs=True, top_logprobs=3)
    b = chat(spec, messages=REPEAT, max_tokens=120, temperature=0, logprobs=True, top_logprobs=3)
    same_choices(a, b)
    assert "paged blocks" in b.choices[0].message.content, b.choices[0].message.content
    p1, s1 = spec_counts(plain), spec_counts(spec)
    assert p1[:3] == p0[:3] == (0, 0, 0), "the plain server drafts nothing"
    drafts, drafted, accepted, steps = (x - y for x, y in zip(s1, s0))
    assert drafts > 0 and drafted >= drafts and 0 < accepted <= drafted, (drafts, drafted, accepted)
    # Each accepted draft token is a token without a step of its own.
    plain_steps = p1[3] - p0[3]
    assert steps == plain_steps - accepted, (steps, plain_steps, accepted)
    # vLLM's acceptance by position: one series per draft position (4), the kept tokens in all.
    m = spec.metrics()
    per_pos = [m[f'kura:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(4)]
    assert f'kura:spec_decode_num_accepted_tokens_per_pos_total{{position="4"}}' not in m
    assert sum(per_pos) == s1[2] and per_pos == sorted(per_pos, reverse=True) and per_pos[3] > 0, per_pos
    assert not any("per_pos" in k for k in plain.metrics()), "the plain server has no draft positions"


@pytest.mark.parametrize("kw", [
    {"temperature": 0.8, "seed": 7, "top_p": 0.9, "logprobs": True, "top_logprobs": 2},
    {"temperature": 1.0, "seed": 11, "frequency_penalty": 0.5, "presence_penalty": 0.3},
    {"temperature": 0.7, "seed": 3, "n": 3, "extra_body": {"repetition_penalty": 1.1, "top_k": 20}},
    {"temperature": 0, "stop": ["disk"]},
    {"temperature": 0, "max_tokens": 3},
], ids=["seeded-top-p-logprobs", "penalties", "three-choices", "stop-string", "max-tokens-3"])
def test_sampled_output_is_the_same_bits(servers, kw):
    plain, spec = servers
    kw = {"max_tokens": 80, **kw}
    same_choices(chat(plain, messages=REPEAT, **kw), chat(spec, messages=REPEAT, **kw))


def test_a_json_schema_and_a_stream_are_the_same(servers):
    plain, spec = servers
    schema = {"type": "object", "properties": {"summary": {"type": "string"}, "tiers": {
        "type": "array", "items": {"type": "string"}}}, "required": ["summary", "tiers"]}
    kw = {"messages": [{"role": "user", "content": "Summarise as JSON: " + DOC}], "max_tokens": 100,
          "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    a, b = chat(plain, **kw), chat(spec, **kw)
    same_choices(a, b)
    json.loads(b.choices[0].message.content)
    streamed = []
    for server in (plain, spec):
        text = ""
        for chunk in chat(server, messages=REPEAT, max_tokens=60, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        streamed.append(text)
    assert streamed[0] == streamed[1] and "paged blocks" in streamed[1], streamed


def test_drafting_pauses_while_the_batch_is_at_disable_by_batch_size(servers):
    """vLLM's `disable_by_batch_size`: three choices decoding together draft nothing at 2 (each pass is
    counted as paused) and give the plain server's tokens; a lone choice drafts."""
    plain, _ = servers
    cfg = json.loads(SPEC) | {"disable_by_batch_size": 2}
    paused = KuraServer("--threads", "1", "--kv-cache-memory", "256MiB", "--speculative-config", json.dumps(cfg))
    try:
        before = paused.metrics()
        kw = {"messages": REPEAT, "max_tokens": 40, "temperature": 0.7, "seed": 5, "n": 3, "logprobs": True}
        same_choices(chat(plain, **kw), chat(paused, **kw))
        after = paused.metrics()
        steps = {k: after[k] - before[k] for k in (
            "kura:spec_decode_paused_steps_total", "kura:spec_decode_num_draft_tokens_total")}
        # 39 decode passes of three choices, whose sampled tokens end none of them early.
        assert steps["kura:spec_decode_paused_steps_total"] >= 30, steps
        assert steps["kura:spec_decode_num_draft_tokens_total"] == 0, steps
        kw = {"messages": REPEAT, "max_tokens": 60, "temperature": 0}
        same_choices(chat(plain, **kw), chat(paused, **kw))
        lone = paused.metrics()
        assert lone["kura:spec_decode_num_accepted_tokens_total"] > 0, "a lone choice drafts"
        assert lone["kura:spec_decode_paused_steps_total"] == after["kura:spec_decode_paused_steps_total"]
    finally:
        paused.stop()


@pytest.mark.parametrize("config,says", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', '"eagle" is not available'),
    ('{"method": "ngram"}', "num_speculative_tokens is missing"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens 99 is outside 1..=32"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
     "prompt_lookup_min 3"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown field `k`"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}',
     "disable_by_batch_size 1 must be at least 2"),
    ("ngram", "not a speculative configuration"),
])
def test_bad_configurations_are_refused_at_start(config, says):
    p = subprocess.run([kura_bin(), "serve", "--model", model_path(), "--port", "0", "--speculative-config", config],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and says in p.stderr, p.stderr[-2000:]


def test_sliding_window_layers_draft_in_whole_blocks_and_not_in_the_hybrid_pool():
    """Gemma 3 (sliding-window layers): the hybrid pool refuses drafts at start and says how to go on;
    with whole-model blocks the drafting server gives the plain one's tokens."""
    from test_gemma import gemma_path

    p = subprocess.run([kura_bin(), "serve", "--model", gemma_path(), "--port", "0", "--kv-cache-memory", "64MiB",
                        "--speculative-config", SPEC], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--no-hybrid-pool" in p.stderr, p.stderr[-2000:]
    args = ("--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--threads", "1", "--no-hybrid-pool")
    plain = KuraServer(*args, model=gemma_path())
    spec = None
    try:
        spec = KuraServer(*args, "--speculative-config", SPEC, model=gemma_path())
        kw = {"messages": REPEAT, "max_tokens": 60, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        same_choices(chat(plain, **kw), chat(spec, **kw))
        assert spec_counts(spec)[2] > 0, "no draft token was kept"
    finally:
        if spec:
            spec.stop()
        plain.stop()
