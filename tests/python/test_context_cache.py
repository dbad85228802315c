"""Context caching through the real server: the Anthropic Messages API with cache_control (the official
`anthropic` client), saved contexts (/v1/caches) that outlive a restart, pins that survive pressure
until their TTL, tenancy, prompt_cache_retention, and a table of bad inputs."""

import os
import time

import anthropic
import httpx
import pytest

from conftest import EXACT, KuraServer, long_text

BLOCK = 16
# The anthropic client has no sampling parameters of its own; the server takes them from the body.
GREEDY = {"temperature": 0}
# The operator key: /debug/clock answers it only.
ADMIN = ("--admin-api-key", "kura-test-operator-key")
ADMIN_HEADERS = {"Authorization": "Bearer kura-test-operator-key"}


def anthropic_client(server: KuraServer, api_key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key or server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def srv():
    s = KuraServer("--kv-cache-memory", "256MiB", "--debug-clock", *ADMIN, *EXACT)
    yield s
    s.stop()


def system_of(tokens_wanted: int, server: KuraServer, seed: int) -> str:
    """A system text of at least `tokens_wanted` tokens."""
    words = tokens_wanted
    while True:
        text = long_text(words, seed=seed)
        if len(server.tokenize(text)) >= tokens_wanted:
            return text
        words += tokens_wanted // 4


def test_messages_cache_control_reports_creation_then_read_with_the_same_text(srv):
    client = anthropic_client(srv)
    model = srv.model()
    system = system_of(2000, srv, seed=1)
    blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": "Name one word from the list."}]
    first = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY, system=blocks, messages=messages)
    assert first.type == "message" and first.role == "assistant"
    assert first.content[0].type == "text" and first.content[0].text
    assert first.stop_reason in ("end_turn", "max_tokens")
    u1 = first.usage
    assert u1.cache_creation_input_tokens >= 1984, u1
    assert u1.cache_read_input_tokens == 0, u1
    second = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY, system=blocks, messages=messages)
    u2 = second.usage
    assert u2.cache_read_input_tokens >= 1984, u2
    assert u2.cache_creation_input_tokens == 0, u2
    assert second.content[0].text == first.content[0].text
    # The three input fields add up to the prompt, both times.
    total1 = u1.input_tokens + u1.cache_creation_input_tokens + u1.cache_read_input_tokens
    total2 = u2.input_tokens + u2.cache_creation_input_tokens + u2.cache_read_input_tokens
    assert total1 == total2 > 2000
    m = srv.metrics()
    assert m["kura:kv_pins"] >= 1 and m["kura:kv_pinned_blocks"] >= 124


def test_messages_stream_has_anthropics_event_sequence_and_usage(srv):
    client = anthropic_client(srv)
    model = srv.model()
    system = system_of(600, srv, seed=2)
    blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}]
    whole = client.messages.create(model=model, max_tokens=10, extra_body=GREEDY, system=blocks, messages=messages)
    kinds, starts, deltas = [], [], []
    with client.messages.stream(model=model, max_tokens=10, extra_body=GREEDY, system=blocks, messages=messages) as s:
        for event in s:
            kinds.append(event.type)
            if event.type == "message_start":
                starts.append(event.message.usage)
            if event.type == "message_delta":
                deltas.append(event.usage)
        final = s.get_final_message()
    assert kinds[0] == "message_start"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert kinds[-1] == "message_stop" and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.cache_read_input_tokens >= 576, final.usage
    # message_start already splits the input as the last usage does (clients read it there).
    start, last = starts[0], deltas[-1]
    assert start.cache_read_input_tokens == last.cache_read_input_tokens >= 576, (start, last)
    assert start.cache_creation_input_tokens == last.cache_creation_input_tokens == 0, (start, last)
    assert start.input_tokens == last.input_tokens and start.output_tokens == 0, (start, last)


def test_messages_stream_start_reports_the_cache_write(srv):
    client = anthropic_client(srv)
    model = srv.model()
    system = system_of(400, srv, seed=3)
    blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": "Say something."}]
    counted = client.messages.count_tokens(model=model, system=blocks, messages=messages).input_tokens
    with client.messages.stream(model=model, max_tokens=4, extra_body=GREEDY, system=blocks, messages=messages) as s:
        starts = [e.message.usage for e in s if e.type == "message_start"]
        final = s.get_final_message().usage
    (start,) = starts
    # At most the template's opening, which every earlier prompt shares, was read.
    assert start.cache_read_input_tokens == final.cache_read_input_tokens < BLOCK, (start, final)
    assert start.cache_creation_input_tokens == final.cache_creation_input_tokens >= 384, (start, final)
    total = start.input_tokens + start.cache_creation_input_tokens + start.cache_read_input_tokens
    assert total == counted, (start, counted)


def test_stop_sequences_report_the_sequence(srv):
    client = anthropic_client(srv)
    model = srv.model()
    free = client.messages.create(model=model, max_tokens=20, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "Count from 1 to 10."}])
    text = free.content[0].text
    assert len(text) > 4, text
    stop = text[2:4]
    cut = client.messages.create(model=model, max_tokens=20, extra_body=GREEDY, stop_sequences=[stop],
                                 messages=[{"role": "user", "content": "Count from 1 to 10."}])
    assert cut.stop_reason == "stop_sequence"
    assert cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_a_last_assistant_message_is_continued_not_answered(srv):
    """Anthropic's prefill: the model goes on from the assistant's text, and the response holds only
    what follows it. Greedy, the continuation of a prefix of the model's own answer is the rest of it."""
    client = anthropic_client(srv)
    model = srv.model()
    ask = [{"role": "user", "content": "Describe the sea in two sentences."}]
    whole = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY, messages=ask).content[0].text
    words = whole.split(" ")
    assert len(words) > 6, whole
    prefix = " ".join(words[:4])
    r = client.messages.create(model=model, max_tokens=8, extra_body=GREEDY,
                               messages=ask + [{"role": "assistant", "content": prefix}])
    rest = r.content[0].text
    assert rest and not rest.startswith(prefix), rest
    assert whole.startswith(prefix + rest), (whole, prefix, rest)
    # The prompt ends inside the assistant's turn: counted as sent, and the turn's opening is cached.
    counted = client.messages.count_tokens(model=model, messages=ask + [{"role": "assistant", "content": prefix}])
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted.input_tokens
    closed = client.messages.count_tokens(model=model, messages=ask).input_tokens
    assert counted.input_tokens > closed
    bad = httpx.post(srv.url + "/v1/messages", headers=srv.headers(), json={
        "model": model, "max_tokens": 5, "messages": ask + [{"role": "assistant", "content": "The sea "}]})
    assert bad.status_code == 400 and "trailing whitespace" in bad.text, bad.text


def test_continue_final_message_continues_the_assistants_text(srv):
    """vLLM's `continue_final_message` on chat completions: as Anthropic's prefill, through the
    `openai` client; /tokenize counts the same prompt; bad combinations are refused by name."""
    c = srv.client()
    model = srv.model()
    ask = [{"role": "user", "content": "Describe a forest in two sentences."}]
    whole = c.chat.completions.create(model=model, messages=ask, max_tokens=24, temperature=0)
    words = whole.choices[0].message.content.split(" ")
    assert len(words) > 6, words
    prefix = " ".join(words[:4])
    msgs = ask + [{"role": "assistant", "content": prefix}]
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    rest = r.choices[0].message.content
    assert rest and whole.choices[0].message.content.startswith(prefix + rest), (prefix, rest)
    t = httpx.post(srv.url + "/tokenize", headers=srv.headers(),
                   json={"messages": msgs, "continue_final_message": True, "add_generation_prompt": False})
    assert t.status_code == 200 and t.json()["count"] == r.usage.prompt_tokens, t.text
    # Without the field the assistant's message is a closed turn, and a new one is answered.
    closed = c.chat.completions.create(model=model, messages=msgs, max_tokens=1, temperature=0)
    assert closed.usage.prompt_tokens > r.usage.prompt_tokens
    for extra, words_ in [({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
                          ({"continue_final_message": True, "response_format": {"type": "json_object"}},
                           "output format")]:
        bad = httpx.post(srv.url + "/v1/chat/completions", headers=srv.headers(),
                         json={"model": model, "messages": msgs, "max_tokens": 4} | extra)
        assert bad.status_code == 400 and words_ in bad.text, bad.text
    bad = httpx.post(srv.url + "/v1/chat/completions", headers=srv.headers(),
                     json={"model": model, "messages": ask, "max_tokens": 4, "continue_final_message": True})
    assert bad.status_code == 400 and "last message from the assistant" in bad.text, bad.text


@pytest.fixture(scope="module")
def small():
    """A pool of 91 blocks, half of which (45) pins may hold; bf16 weights (faster, no exactness needed)."""
    s = KuraServer("--kv-cache-memory", "32MiB", "--kv-pin-budget", "50%", "--debug-clock", *ADMIN)
    yield s
    s.stop()


def test_a_pin_over_the_budget_is_demoted_not_refused(small):
    client = anthropic_client(small)
    system = system_of(800, small, seed=9)  # 50 blocks > 45
    blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    r = client.messages.create(model=small.model(), max_tokens=1, extra_body=GREEDY, system=blocks,
                               messages=[{"role": "user", "content": "Hi."}])
    assert r.usage.cache_creation_input_tokens >= 784
    m = small.metrics()
    assert m["kura:kv_pins_demoted_total"] >= 1
    assert m["kura:kv_pinned_blocks"] <= m["kura:kv_pin_budget_blocks"] == 45


def test_pinned_prefix_survives_ten_pools_of_traffic_until_its_ttl(small):
    srv = small
    client = anthropic_client(srv)
    model = srv.model()
    system = system_of(480, srv, seed=3)  # 30 blocks, within the budget of 45
    blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "5m"}}]
    ask = [{"role": "user", "content": "Hello."}]
    r = client.messages.create(model=model, max_tokens=1, extra_body=GREEDY, system=blocks, messages=ask)
    assert r.usage.cache_creation_input_tokens >= 464
    pool_tokens = srv.metrics()["kura:kv_cache_blocks_total"] * BLOCK

    def flood(pools: int):
        # Unique prompts of ~600 tokens until `pools` pools' worth has gone through.
        sent, i = 0, 0
        oa = srv.client()
        while sent < pools * pool_tokens:
            prompt = long_text(450, seed=1000 + i + int(time.time() * 1000) % 100000)
            out = oa.completions.create(model=model, prompt=f"{i} {prompt}", max_tokens=1, temperature=0)
            sent += out.usage.prompt_tokens
            i += 1

    flood(10)
    r = client.messages.create(model=model, max_tokens=1, extra_body=GREEDY, system=blocks, messages=ask)
    assert r.usage.cache_read_input_tokens >= 464, r.usage
    # Past its TTL (the cache clock moved 6 minutes), the pin is released and traffic evicts it: two
    # pools' worth of unique prompts replace every unpinned block.
    httpx.post(srv.url + "/debug/clock", json={"advance_s": 360}, headers=ADMIN_HEADERS).raise_for_status()
    flood(2)
    r = client.messages.create(model=model, max_tokens=1, extra_body=GREEDY, system=blocks, messages=ask)
    assert r.usage.cache_read_input_tokens < 464, r.usage
    assert srv.metrics()["kura:kv_pins_expired_total"] >= 1


def test_saved_context_is_used_by_chat_completions_and_messages(srv):
    doc = system_of(700, srv, seed=4)
    r = httpx.post(srv.url + "/v1/caches", headers=srv.headers(), timeout=120,
                   json={"model": srv.model(), "messages": [{"role": "system", "content": doc}],
                         "ttl": "600s", "display_name": "doc"})
    assert r.status_code == 200, r.text
    ctx = r.json()
    assert ctx["id"].startswith("ctx_") and ctx["token_count"] >= 700
    assert ctx["expires_at"] - ctx["created_at"] == 600
    listed = httpx.get(srv.url + "/v1/caches", headers=srv.headers()).json()["data"]
    assert ctx["id"] in [c["id"] for c in listed]
    oa = srv.client()
    chat = oa.chat.completions.create(model=srv.model(), max_tokens=5, temperature=0,
                                      messages=[{"role": "user", "content": "Summarise."}],
                                      extra_body={"cached_content": ctx["id"]})
    assert chat.usage.prompt_tokens_details.cached_tokens >= ctx["token_count"] - BLOCK
    # The same prompt sent in full gives the same text.
    full = oa.chat.completions.create(model=srv.model(), max_tokens=5, temperature=0,
                                      messages=[{"role": "system", "content": doc},
                                                {"role": "user", "content": "Summarise."}])
    assert full.choices[0].message.content == chat.choices[0].message.content
    msg = anthropic_client(srv).messages.create(
        model=srv.model(), max_tokens=5,
        messages=[{"role": "user", "content": "Summarise."}], extra_body={"cached_content": ctx["id"], **GREEDY})
    assert msg.usage.cache_read_input_tokens >= ctx["token_count"] - BLOCK
    # PATCH changes the expiry (and nothing else: a field it would drop is refused); DELETE removes it.
    p = httpx.patch(srv.url + f"/v1/caches/{ctx['id']}", headers=srv.headers(),
                    json={"ttl": "3h", "display_name": "renamed"})
    assert p.status_code == 400 and "only ttl can be changed; display_name" in p.json()["error"]["message"], p.text
    p = httpx.patch(srv.url + f"/v1/caches/{ctx['id']}", headers=srv.headers(), json={"ttl": "2h"})
    assert p.status_code == 200 and p.json()["expires_at"] - ctx["created_at"] >= 7200
    d = httpx.delete(srv.url + f"/v1/caches/{ctx['id']}", headers=srv.headers())
    assert d.status_code == 200 and d.json()["deleted"] is True
    g = httpx.get(srv.url + f"/v1/caches/{ctx['id']}", headers=srv.headers())
    assert g.status_code == 404


def test_saved_context_expires_on_the_cache_clock(srv):
    r = httpx.post(srv.url + "/v1/caches", headers=srv.headers(), timeout=120,
                   json={"prompt": long_text(100, seed=5), "ttl": 60})
    assert r.status_code == 200, r.text
    cid = r.json()["id"]
    assert httpx.get(srv.url + f"/v1/caches/{cid}", headers=srv.headers()).status_code == 200
    httpx.post(srv.url + "/debug/clock", json={"advance_s": 61}, headers=ADMIN_HEADERS).raise_for_status()
    g = httpx.get(srv.url + f"/v1/caches/{cid}", headers=srv.headers())
    assert g.status_code == 404 and "expired" in g.json()["error"]["message"]


def test_prompt_cache_retention_24h_pins_the_prompt(srv):
    oa = srv.client()
    prompt = long_text(400, seed=6)
    before = srv.metrics()["kura:kv_pins"]
    out = oa.completions.create(model=srv.model(), prompt=prompt, max_tokens=1, temperature=0,
                                extra_body={"prompt_cache_retention": "24h", "prompt_cache_key": "doc-6"})
    assert out.usage.prompt_tokens >= 400
    assert out.usage.prompt_tokens_details.cache_write_tokens >= 384
    assert srv.metrics()["kura:kv_pins"] == before + 1
    again = oa.completions.create(model=srv.model(), prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"prompt_cache_retention": "24h"})
    assert again.usage.prompt_tokens_details.cached_tokens >= 384
    assert again.usage.prompt_tokens_details.cache_write_tokens == 0
    assert srv.metrics()["kura:kv_pins"] == before + 1  # refreshed, not pinned twice


def test_tenants_neither_see_nor_hit_each_others_contexts():
    s = KuraServer("--kv-cache-memory", "128MiB", "--api-key", "key-a", "--api-key", "key-b", *EXACT,
                   api_key="key-a")
    try:
        doc = long_text(600, seed=7)
        a = {"Authorization": "Bearer key-a"}
        b = {"x-api-key": "key-b"}
        r = httpx.post(s.url + "/v1/caches", headers=a, timeout=120, json={"prompt": doc, "ttl": "1h"})
        assert r.status_code == 200, r.text
        cid = r.json()["id"]
        assert httpx.get(s.url + f"/v1/caches/{cid}", headers=b).status_code == 404
        assert httpx.delete(s.url + f"/v1/caches/{cid}", headers=b).status_code == 404
        assert cid not in [c["id"] for c in httpx.get(s.url + "/v1/caches", headers=b).json()["data"]]
        used = httpx.post(s.url + "/v1/completions", headers=b, timeout=60,
                          json={"prompt": " tail", "max_tokens": 1, "cached_content": cid})
        assert used.status_code == 404
        # Tenant B sending A's document as text computes it: no hit on A's pinned blocks.
        cold = httpx.post(s.url + "/v1/completions", headers=b, timeout=120,
                          json={"prompt": doc + " tail", "max_tokens": 1}).json()
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Tenant A does hit (through its context).
        warm = httpx.post(s.url + "/v1/completions", headers=a, timeout=120,
                          json={"prompt": " tail", "max_tokens": 1, "cached_content": cid}).json()
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 560
        # Anthropic's client authenticates with x-api-key; a wrong key gets Anthropic's error shape.
        bad = httpx.post(s.url + "/v1/messages", headers={"x-api-key": "nope"},
                         json={"model": s.model(), "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
        assert bad.status_code == 401 and bad.json()["type"] == "error"
        assert bad.json()["error"]["type"] == "authentication_error"
        # Its token counts too.
        bad = httpx.post(s.url + "/v1/messages/count_tokens", headers={"x-api-key": "nope"},
                         json={"model": s.model(), "messages": [{"role": "user", "content": "x"}]})
        assert bad.status_code == 401 and bad.json()["type"] == "error", bad.text
        assert bad.json()["error"]["type"] == "authentication_error", bad.text
    finally:
        s.stop()


BAD = [
    # (route, body, status, words in the message)
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 400, "model is required"),
    ("/v1/messages", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens is required"),
    ("/v1/messages", {"model": "other", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 5, "messages": []}, 400, "at least one message"),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 5,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                                 "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]},
     400, "\"5m\" or \"1h\""),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 5,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                                 "cache_control": {"type": "forever"}}]}]},
     400, "ephemeral"),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 5,
                      "messages": [{"role": "user", "content": [
                          {"type": "text", "text": f"p{i}", "cache_control": {"type": "ephemeral"}} for i in range(5)]}]},
     400, "at most 4"),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 5,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "",
                                                                 "cache_control": {"type": "ephemeral"}}]}]},
     400, "empty text block"),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 5, "cached_content": "ctx_000000000000000000000000",
                      "messages": [{"role": "user", "content": "x"}]}, 404, "no saved context"),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     400, "only text blocks"),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 100000,
                      "system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}],
                      "messages": [{"role": "user", "content": "x"}]}, 400, "context"),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 5, "stop_sequences": "END",
                      "messages": [{"role": "user", "content": "x"}]}, 400, "stop_sequences must be an array"),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 5, "stop_sequences": ["z" * 5000],
                      "messages": [{"role": "user", "content": "x"}]}, 400, "stop_sequences[0] may be at most 4096 bytes"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": [{"role": "user", "content": "x"}],
                              "cached_content": "ctx_nope"}, 404, "no saved context"),
    ("/v1/completions", {"model": "MODEL", "prompt": "x", "cache_salt": "s",
                         "cached_content": "ctx_000000000000000000000000"}, 400, "cannot be combined"),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 5, "service_tier": "flex",
                      "messages": [{"role": "user", "content": "x"}]}, 400, "service_tier must be one of auto"),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 5, "metadata": {"user_id": 5},
                      "messages": [{"role": "user", "content": "x"}]}, 400, "metadata.user_id must be a string"),
    ("/v1/messages", {"model": "MODEL", "max_tokens": 5, "cache_salt": "s",
                      "cached_content": "ctx_000000000000000000000000",
                      "messages": [{"role": "user", "content": "x"}]}, 400, "cannot be combined"),
    ("/v1/completions", {"model": "MODEL", "prompt": "x", "prompt_cache_retention": "forever"}, 400,
     "prompt_cache_retention"),
    ("/v1/caches", {"prompt": "x", "ttl": "0s"}, 400, "ttl must be"),
    ("/v1/caches", {"prompt": "x", "ttl": "soon"}, 400, "ttl must be"),
    ("/v1/caches", {"prompt": "x", "ttl": -5}, 400, "ttl must be"),
    ("/v1/caches", {"prompt": "x", "ttl": "9999d"}, 400, "ttl must be"),
    ("/v1/caches", {"ttl": "1h"}, 400, "exactly one of messages"),
    ("/v1/caches", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "exactly one of messages"),
    ("/v1/caches", {"prompt": ""}, 400, "non-empty"),
    ("/v1/caches", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools are not saved with a context"),
    ("/v1/caches", {"prompt": "x", "cache_salt": "s"}, 400, "belongs to its API key"),
    ("/v1/caches", {"prompt": "x", "cached_content": "ctx_000000000000000000000000"}, 400,
     "cannot start from another"),
    ("/v1/caches", {"model": "other", "prompt": "x"}, 404, "does not exist"),
    ("/v1/caches", {"prompt": "x", "ttl_seconds": 60}, 400, "ttl_seconds is not a field of caches"),
]


@pytest.mark.parametrize("route,body,status,words", BAD, ids=[f"{r}:{w}" for r, _, _, w in BAD])
def test_bad_inputs_get_a_status_and_a_message_naming_the_problem(srv, route, body, status, words):
    body = {k: (srv.model() if v == "MODEL" else v) for k, v in body.items()}
    r = httpx.post(srv.url + route, json=body, headers=srv.headers(), timeout=60)
    assert r.status_code == status, r.text
    j = r.json()
    message = j["error"]["message"]
    assert words in message, message
    if route == "/v1/messages":
        assert j["type"] == "error" and j["error"]["type"] in ("invalid_request_error", "not_found_error")


def test_a_saved_context_of_another_model_is_refused_and_survives_a_restart(tmp_path):
    disk = str(tmp_path / "kv")
    s = KuraServer("--kv-cache-memory", "128MiB", "--kv-disk-path", disk, *EXACT)
    try:
        doc = long_text(300, seed=8)
        r = httpx.post(s.url + "/v1/caches", headers=s.headers(), timeout=120, json={"prompt": doc, "ttl": "1h"})
        assert r.status_code == 200, r.text
        cid = r.json()["id"]
        other = httpx.post(s.url + "/v1/caches", headers=s.headers(), timeout=120, json={"prompt": doc + " x"})
        oid = other.json()["id"]
        edited = httpx.post(s.url + "/v1/caches", headers=s.headers(), timeout=120, json={"prompt": doc + " y"})
        eid = edited.json()["id"]
    finally:
        assert s.stop() == 0
    # Another model's context: the file says so.
    import json, pathlib
    f = pathlib.Path(disk) / "contexts" / f"{oid}.json"
    rec = json.loads(f.read_text())
    rec["fingerprint"] = "0" * 32
    rec["model"] = "some-other-model"
    f.write_text(json.dumps(rec))
    # A record whose tokens were changed: valid JSON, but not its text's tokens.
    f = pathlib.Path(disk) / "contexts" / f"{eid}.json"
    rec = json.loads(f.read_text())
    rec["tokens"][0] += 1
    f.write_text(json.dumps(rec))
    # A damaged file is set aside, not served; a FIFO is never opened (reading it would block the start).
    (pathlib.Path(disk) / "contexts" / "ctx_ffffffffffffffffffffffff.json").write_text("{not json")
    os.mkfifo(pathlib.Path(disk) / "contexts" / "ctx_eeeeeeeeeeeeeeeeeeeeeeee.json")
    # A link to a valid record kept elsewhere: set aside, not followed (followed, it would be served).
    linked = "ctx_dddddddddddddddddddddddd"
    rec = json.loads((pathlib.Path(disk) / "contexts" / f"{cid}.json").read_text())
    rec["id"] = linked
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(rec))
    os.symlink(elsewhere, pathlib.Path(disk) / "contexts" / f"{linked}.json")
    s = KuraServer("--kv-cache-memory", "128MiB", "--kv-disk-path", disk, *EXACT)
    try:
        warm = httpx.post(s.url + "/v1/completions", headers=s.headers(), timeout=120,
                          json={"prompt": " tail", "max_tokens": 1, "cached_content": cid}).json()
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 288, warm
        bad = httpx.post(s.url + "/v1/completions", headers=s.headers(), timeout=60,
                         json={"prompt": " tail", "max_tokens": 1, "cached_content": oid})
        assert bad.status_code == 400 and "was built for model" in bad.json()["error"]["message"]
        assert "damaged" in s.log()
        assert (pathlib.Path(disk) / "contexts" / "ctx_ffffffffffffffffffffffff.json.bad").exists()
        assert (pathlib.Path(disk) / "contexts" / "ctx_eeeeeeeeeeeeeeeeeeeeeeee.json.bad").exists()
        assert (pathlib.Path(disk) / "contexts" / f"{linked}.json.bad").is_symlink()
        gone = httpx.post(s.url + "/v1/completions", headers=s.headers(), timeout=60,
                          json={"prompt": " tail", "max_tokens": 1, "cached_content": linked})
        assert gone.status_code == 404, gone.text
        damaged = httpx.post(s.url + "/v1/completions", headers=s.headers(), timeout=60,
                             json={"prompt": " tail", "max_tokens": 1, "cached_content": eid})
        assert damaged.status_code == 400, damaged.text
        assert damaged.json()["error"]["code"] == "cache_damaged", damaged.text
        assert (pathlib.Path(disk) / "contexts" / f"{eid}.json.bad").exists()
    finally:
        s.stop()


def test_kura_cache_build_computes_a_context_offline_that_a_server_then_serves(tmp_path):
    import subprocess
    from conftest import kura_bin, model_path
    disk = str(tmp_path / "kv")
    doc = tmp_path / "doc.txt"
    doc.write_text(long_text(500, seed=10))
    out = subprocess.run([kura_bin(), "cache", "build", "--model", model_path(), "--kv-cache-memory", "64MiB",
                          "--kv-disk-path", disk, "--file", str(doc), "--ttl", "2h", "--display-name", "manual"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    cid = out.stdout.strip()
    assert cid.startswith("ctx_"), out.stdout
    # A document may come from a pipe (`--file <(make-doc)`, here stdin): read as the stream it is.
    piped = subprocess.run([kura_bin(), "cache", "build", "--model", model_path(), "--kv-cache-memory", "64MiB",
                            "--kv-disk-path", disk, "--file", "/dev/stdin", "--display-name", "piped"],
                           input=long_text(80, seed=11), capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    listed = subprocess.run([kura_bin(), "cache", "list", "--kv-disk-path", disk], capture_output=True, text=True)
    assert cid in listed.stdout and "manual" in listed.stdout
    assert piped.stdout.strip() in listed.stdout and "piped" in listed.stdout
    s = KuraServer("--kv-cache-memory", "64MiB", "--kv-disk-path", disk)
    try:
        got = httpx.get(s.url + f"/v1/caches/{cid}", headers=s.headers()).json()
        assert got["token_count"] >= 500 and got["display_name"] == "manual"
        r = httpx.post(s.url + "/v1/completions", headers=s.headers(), timeout=120,
                       json={"prompt": " and then", "max_tokens": 1, "cached_content": cid}).json()
        # Every whole block of the document came from the disk tier: nothing was recomputed but the seam.
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= got["token_count"] - BLOCK, r
        assert s.metrics()['kura:kv_tier_hit_blocks_total{tier="disk"}'] >= got["token_count"] // BLOCK - 1
    finally:
        s.stop()
    # A key from --api-key-file owns the context as one from --api-key does: its tenant sees it, others not.
    keys = tmp_path / "keys.txt"
    keys.write_text("key-a\n")
    owned = subprocess.run([kura_bin(), "cache", "build", "--model", model_path(), "--kv-cache-memory", "64MiB",
                            "--kv-disk-path", disk, "--file", "/dev/stdin", "--api-key-file", str(keys)],
                           input=long_text(80, seed=12), capture_output=True, text=True, timeout=300)
    assert owned.returncode == 0, owned.stderr
    owned_id = owned.stdout.strip()
    s = KuraServer("--kv-cache-memory", "64MiB", "--kv-disk-path", disk, "--api-key", "key-a", "--api-key", "key-b")
    try:
        mine = httpx.get(s.url + f"/v1/caches/{owned_id}", headers={"Authorization": "Bearer key-a"})
        assert mine.status_code == 200, mine.text
        theirs = httpx.get(s.url + f"/v1/caches/{owned_id}", headers={"Authorization": "Bearer key-b"})
        assert theirs.status_code == 404, theirs.text
    finally:
        s.stop()
    rm = subprocess.run([kura_bin(), "cache", "rm", "--kv-disk-path", disk, cid], capture_output=True, text=True)
    assert rm.returncode == 0 and f"deleted {cid}" in rm.stdout
    again = subprocess.run([kura_bin(), "cache", "rm", "--kv-disk-path", disk, cid], capture_output=True, text=True)
    assert again.returncode != 0 and "no saved context" in again.stderr
    for args, words in [
        (["--file", str(doc)], "needs --kv-disk-path"),
        (["--kv-disk-path", disk], "give the document to save"),
        (["--kv-disk-path", disk, "--file", str(doc), "--ttl", "forever"], "--ttl"),
        (["--kv-disk-path", disk, "--file", str(tmp_path / "missing.txt")], "reading --file"),
        (["--kv-disk-path", disk, "--messages-json", str(doc)], "expected an array"),
        (["--kv-disk-path", disk, "--file", str(doc), "--api-key", "key-b", "--api-key-file", str(keys)],
         "give at most one API key"),
        # A file that never ends stops at the limit, named.
        (["--kv-disk-path", disk, "--file", "/dev/zero"], "larger than the 268435456 bytes"),
        (["--kv-disk-path", disk, "--messages-json", "/dev/zero"], "larger than the 268435456 bytes"),
    ]:
        bad = subprocess.run([kura_bin(), "cache", "build", "--model", model_path(), "--kv-cache-memory", "64MiB",
                              *args], capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and words in bad.stderr, (args, bad.stderr)
