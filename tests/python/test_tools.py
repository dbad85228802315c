"""Tool calling through the official `openai` client against a real `kura serve` on the default model
(whose chat template has no tools section: tools are written by Kura's fallback format and calls read back
as Hermes writes them): `required` and named calls are constrained to the function's schema, so their
arguments always parse; streamed calls arrive as OpenAI streams them; the conversation goes on with the
tool's result and reuses the previous turn's KV; bad tool requests are a 400 naming the problem.
"""

import json

import httpx
import jsonschema
import openai
import pytest

from conftest import BLOCK, KuraServer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"},
                   "hour24": {"type": "boolean"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a time zone",
                                      "parameters": TIME}},
]
SCHEMA = {"get_weather": WEATHER, "get_time": TIME}
SYSTEM = "You are a helpful assistant. Use the tools to answer. " * 12


@pytest.fixture(scope="module")
def server():
    s = KuraServer("--kv-cache-memory", "256MiB")
    yield s
    s.stop()


def check_calls(calls) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function"
        assert call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])


def ask(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_required_and_named_calls_parse_and_validate(server):
    c = server.client()
    model = server.model()
    for choice in ["required", {"type": "function", "function": {"name": "get_time"}}]:
        for temperature in (0.0, 1.0):
            r = c.chat.completions.create(model=model, messages=ask("What time is it in Tokyo?"), tools=TOOLS,
                                          tool_choice=choice, parallel_tool_calls=False, max_tokens=300,
                                          temperature=temperature, seed=1)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls", ch
            check_calls(ch.message.tool_calls)
            assert ch.message.content is None
            if isinstance(choice, dict):
                assert {t.function.name for t in ch.message.tool_calls} == {"get_time"}


def test_a_named_function_is_called_exactly_once(server):
    """OpenAI's forced function is one call of it, even with `parallel_tool_calls` (by default true):
    a question that asks for two cities still gets one call (chat and Responses alike)."""
    c = server.client()
    model = server.model()
    msgs = ask("What is the weather in Paris and in Rome?")
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        for parallel in (None, True):
            extra = {} if parallel is None else {"parallel_tool_calls": parallel}
            r = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice=named, max_tokens=300,
                                          temperature=1, seed=seed, **extra)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
            check_calls(ch.message.tool_calls)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r = c.responses.create(model=model, input="What is the weather in Paris and in Rome?", tools=tools,
                           tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=300,
                           temperature=0, store=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", r.output


def test_streamed_calls_arrive_as_openai_streams_them(server):
    c = server.client()
    model = server.model()
    kw = dict(model=model, messages=ask("Weather in Oslo, in celsius?"), tools=TOOLS, max_tokens=300,
              temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}},
              parallel_tool_calls=False)
    whole = c.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    pieces = 0
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            assert not ch.delta.content, ch
            for d in ch.delta.tool_calls or []:
                pieces += 1
                if d.index not in calls:
                    # The first piece of a call names it.
                    assert d.id and d.type == "function" and d.function.name, d
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None, d
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert pieces > len(calls) + 2, "arguments should arrive in several pieces"
    assert [(x["name"], x["arguments"]) for _, x in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in whole]
    for x in calls.values():
        jsonschema.validate(json.loads(x["arguments"]), SCHEMA[x["name"]])


def test_parallel_calls_each_validate_and_can_be_turned_off(server):
    c = server.client()
    model = server.model()
    msgs = ask("What is the weather in Paris and in Rome, and the time in Europe/Paris?")
    for seed in range(3):
        r = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=True, max_tokens=400, temperature=1, seed=seed)
        # A model that keeps adding calls reaches max_tokens: the calls it finished still stand.
        assert r.choices[0].finish_reason in ("tool_calls", "length"), r
        check_calls(r.choices[0].message.tool_calls)
        r = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=400, temperature=1, seed=seed)
        assert len(r.choices[0].message.tool_calls) == 1
        check_calls(r.choices[0].message.tool_calls)


def test_the_tool_result_continues_the_conversation_from_the_cache(server):
    c = server.client()
    model = server.model()
    msgs = ask("What is the weather in Lisbon?")
    first = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=200, extra_body={"temperature": 0})
    calls = first.choices[0].message.tool_calls
    check_calls(calls)
    msgs.append(first.choices[0].message.model_dump(exclude_none=True))
    for call in calls:
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})})
    second = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=30, extra_body={"temperature": 0})
    cached = second.usage.prompt_tokens_details.cached_tokens
    previous = first.usage.prompt_tokens
    # The whole previous prompt (its full blocks) and the calls' text, written back exactly as generated.
    assert cached >= previous // BLOCK * BLOCK, (cached, previous)
    assert second.usage.prompt_tokens > previous + first.usage.completion_tokens
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_and_auto(server):
    c = server.client()
    model = server.model()
    r = c.chat.completions.create(model=model, messages=ask("Say hello."), tools=TOOLS, tool_choice="none",
                                  max_tokens=20, extra_body={"temperature": 0})
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")
    r = c.chat.completions.create(model=model, messages=ask("Weather in Bern?"), tools=TOOLS,
                                  max_tokens=120, extra_body={"temperature": 0})
    ch = r.choices[0]
    if ch.message.tool_calls:
        assert ch.finish_reason == "tool_calls"
        for t in ch.message.tool_calls:
            json.loads(t.function.arguments)
    else:
        assert ch.message.content


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "has no name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "1 to 64 letters"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "must be \"function\""),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "has no tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "got \"always\""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/nowhere"}}}}}], "tool_choice": "required"},
     "tools", "could not be compiled"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
      "tool_choice": "required"}, "tools", "must describe a JSON object"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "tool", "tool_call_id": "call_1", "content": "42"}]}, "messages",
     "no earlier assistant message called"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}, "messages",
     "no tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages", "must be a JSON object"),
]


@pytest.mark.parametrize("extra,param,words", BAD)
def test_bad_tool_requests_are_400s_that_name_the_problem(server, extra, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"], err


# Anthropic's shape: tools with input_schema, tool_use and tool_result blocks, cache_control on tools.

import anthropic  # noqa: E402

A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


def claude(server: KuraServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0)


def check_tool_uses(content) -> list:
    uses = [b for b in content if b.type == "tool_use"]
    assert uses, content
    for b in uses:
        assert b.id.startswith("toolu_")
        jsonschema.validate(b.input, SCHEMA[b.name])
    return uses


def test_anthropic_tool_use_any_and_named(server):
    c = claude(server)
    model = server.model()
    for choice in [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}]:
        r = c.messages.create(model=model, max_tokens=300, system=SYSTEM, tools=A_TOOLS, tool_choice=choice,
                              messages=[{"role": "user", "content": "Weather in Madrid?"}], extra_body={"temperature": 0})
        assert r.stop_reason in ("tool_use", "max_tokens"), r
        uses = check_tool_uses(r.content)
        if choice["type"] == "tool":
            assert {u.name for u in uses} == {"get_weather"}
    r = c.messages.create(model=model, max_tokens=300, system=SYSTEM, tools=A_TOOLS,
                          tool_choice={"type": "any", "disable_parallel_tool_use": True},
                          messages=[{"role": "user", "content": "Weather in Madrid and in Porto?"}], extra_body={"temperature": 1})
    assert len(check_tool_uses(r.content)) == 1


def test_anthropic_streams_input_json_deltas(server):
    c = claude(server)
    model = server.model()
    kw = dict(model=model, max_tokens=300, system=SYSTEM, tools=A_TOOLS, extra_body={"temperature": 0},
              tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
              messages=[{"role": "user", "content": "Time in Asia/Tokyo?"}])
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(deltas) > 2, events
    starts = [e for e in events if e.type == "content_block_start"]
    assert starts and starts[0].content_block.type == "tool_use", starts
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
    check_tool_uses(final.content)


def test_anthropic_tool_result_continues_from_the_cache_and_tools_cache(server):
    c = claude(server)
    model = server.model()
    # Tools no other test sent (their prefix is not cached yet), a breakpoint after the last.
    tools = [dict(t, description=t["description"] + " (kept)") for t in A_TOOLS]
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    msgs = [{"role": "user", "content": "What is the weather in Vienna?"}]
    first = c.messages.create(model=model, max_tokens=200, system=SYSTEM, tools=tools, messages=msgs,
                              tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    uses = check_tool_uses(first.content)
    # The breakpoint on the last tool wrote the tools' prefix into the cache.
    assert first.usage.cache_creation_input_tokens > 0, first.usage
    msgs.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    msgs.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": u.id, "content": "12 degrees, light rain"} for u in uses]})
    second = c.messages.create(model=model, max_tokens=30, system=SYSTEM, tools=tools, messages=msgs,
                               extra_body={"temperature": 0})
    u1 = first.usage
    previous = u1.input_tokens + u1.cache_read_input_tokens + u1.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens >= previous // BLOCK * BLOCK, (second.usage, previous)
    # Another conversation with the same tools starts from the cached tools.
    other = c.messages.create(model=model, max_tokens=5, system="Different system text.", tools=tools,
                              messages=[{"role": "user", "content": "Hello"}], extra_body={"temperature": 0})
    assert other.usage.cache_read_input_tokens >= u1.cache_creation_input_tokens // BLOCK * BLOCK - BLOCK, \
        (other.usage, u1)
    assert other.usage.cache_read_input_tokens > 0


A_BAD = [
    ({"tools": [{"name": "f"}]}, "input_schema is missing"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "server tool"),
    ({"tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
    ({"tool_choice": {"type": "any"}}, "has no tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]},
     "no earlier assistant message called"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": "x"}]}]},
     "input must be an object"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens must be an integer of at least 1024"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "must describe a JSON object"),
]


@pytest.mark.parametrize("extra,words", A_BAD)
def test_bad_anthropic_tool_requests_are_400s(server, extra, words):
    body = {"model": server.model(), "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(server.url + "/v1/messages", json=body, headers=server.headers())
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert words in err["error"]["message"], err


def test_anthropic_output_config_format_constrains_the_text(server):
    """`output_config.format` on /v1/messages: the text is JSON valid under the schema, streamed or not."""
    c = claude(server)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "celsius": {"type": "integer"}},
              "required": ["city", "celsius"], "additionalProperties": False}
    kw = dict(model=server.model(), max_tokens=60, messages=[{"role": "user", "content": "Weather in Oslo?"}],
              extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    r = c.messages.create(**kw)
    text = "".join(b.text for b in r.content if b.type == "text")
    jsonschema.validate(json.loads(text), schema)
    with c.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
    assert streamed == text
    r = c.messages.create(model=server.model(), max_tokens=10, messages=[{"role": "user", "content": "Yes or no?"}],
                          extra_body={"temperature": 0, "output_config": {"format": {
                              "type": "json_schema", "schema": {"enum": ["yes", "no"]}}}})
    assert "".join(b.text for b in r.content if b.type == "text") in ('"yes"', '"no"'), r


def test_anthropic_count_tokens_is_the_prompt_messages_computes(server):
    """`messages.count_tokens` counts what `/v1/messages` computes for the same system prompt, messages
    and tools (its usage's three input counts), with tools, tool turns and breakpoints too."""
    c = claude(server)
    model = server.model()
    uses = [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Lima", "unit": "celsius"}}]
    turns = [{"role": "user", "content": "Weather in Lima?"}, {"role": "assistant", "content": uses},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "19 degrees"}]}]
    cached_system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    bodies = [
        dict(messages=[{"role": "user", "content": "Hello"}]),
        dict(system=SYSTEM, messages=[{"role": "user", "content": "Hello"}]),
        dict(system=SYSTEM, tools=A_TOOLS, tool_choice={"type": "any"}, messages=[{"role": "user", "content": "Hi"}]),
        dict(system=SYSTEM, tools=A_TOOLS, messages=turns),
        dict(system=cached_system, messages=[{"role": "user", "content": "Hello"}]),
    ]
    counts = []
    for body in bodies:
        n = c.messages.count_tokens(model=model, **body).input_tokens
        u = c.messages.create(model=model, max_tokens=1, extra_body={"temperature": 0}, **body).usage
        assert n == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens, (body, n, u)
        counts.append(n)
    # The system prompt, the tools and the tool turns are all counted.
    assert counts[0] < counts[1] < counts[2] < counts[3], counts
    assert counts[4] == counts[1], counts
    # The count is a count: it caches nothing (the next request with a new system prompt misses).
    fresh = "A system prompt nobody has sent before. " * 10
    c.messages.count_tokens(model=model, system=fresh, messages=[{"role": "user", "content": "Hello"}])
    after = c.messages.create(model=model, max_tokens=1, system=fresh, messages=[{"role": "user", "content": "Hello"}],
                              extra_body={"temperature": 0}).usage
    assert after.cache_read_input_tokens < BLOCK * 2, after


@pytest.mark.parametrize("extra,status,words", [
    ({"max_tokens": 5}, 400, "max_tokens is not a field of count_tokens"),
    ({"stream": True}, 400, "stream is not a field of count_tokens"),
    ({"model": "no-such-model"}, 404, "no-such-model"),
    ({"messages": []}, 400, "at least one message"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, 400, "thinking.budget_tokens must be"),
    ({"tools": [{"name": "f"}]}, 400, "input_schema is missing"),
])
def test_bad_count_tokens_requests_name_the_problem(server, extra, status, words):
    body = {"model": server.model(), "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(server.url + "/v1/messages/count_tokens", json=body, headers=server.headers())
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and words in err["error"]["message"], err
