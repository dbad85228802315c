"""Tools on a model whose chat template writes them itself: `kura serve --chat-template` gives the default
model a template in the form of Qwen2.5's (a tools section, calls in `<tool_call>` tags, results in
`<tool_response>`), through the official `openai` and `anthropic` clients. Calls are read as the template
writes them and only for the tools offered; Anthropic's `cache_control` breakpoints are placed in the text
the template writes with the tools; an output format beside tools the model may call lets it call one or
answer in that format; a template file that cannot be read or does not compile stops the server, named.
"""

import json
import os
import subprocess

import anthropic
import httpx
import jsonschema
import pytest

from conftest import BLOCK, KuraServer, kura_bin, model_path

TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "hermes_tools.jinja")
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}}]
SYSTEM = "You are a helpful assistant. Use the tools to answer questions about the weather. " * 8


@pytest.fixture(scope="module")
def server():
    s = KuraServer("--kv-cache-memory", "256MiB", "--chat-template", TEMPLATE)
    yield s
    s.stop()


def ask(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def tokenize(server: KuraServer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    body = {"messages": messages} | ({"tools": tools} if tools else {})
    r = httpx.post(server.url + "/tokenize", json=body, headers=server.headers())
    r.raise_for_status()
    return r.json()["tokens"]


def test_the_template_writes_the_tools_and_calls_read_back_in_its_format(server):
    c = server.client()
    model = server.model()
    plain = tokenize(server, ask("Weather in Oslo?"))
    with_tools = tokenize(server, ask("Weather in Oslo?"), TOOLS)
    # The tools section is the template's: in the system turn, ahead of the conversation.
    assert len(with_tools) > len(plain) + 40, (len(with_tools), len(plain))
    r = c.chat.completions.create(model=model, messages=ask("Weather in Oslo?"), tools=TOOLS,
                                  tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                  temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # The result goes back in the template's own form and the conversation goes on from the cache.
    msgs = ask("Weather in Oslo?") + [ch.message.model_dump(exclude_none=True),
                                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=20, temperature=0)
    assert second.usage.prompt_tokens > r.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens // BLOCK * BLOCK - BLOCK


def test_anthropic_breakpoints_are_placed_in_the_text_written_with_the_tools(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "Current weather of a city", "input_schema": WEATHER,
              "cache_control": {"type": "ephemeral"}}]
    # A system prompt of its own: nothing of it is cached before this test.
    text = "You answer questions about the weather in Europe, briefly. " * 8
    system = [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]
    kw = dict(model=server.model(), max_tokens=16, system=system, tools=tools, extra_body={"temperature": 0})
    first = client.messages.create(messages=[{"role": "user", "content": "Weather in Paris?"}], **kw)
    u = first.usage
    total = u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens
    # The system prompt (with the template's tools section) is written to the cache at its breakpoint.
    # (Its first tokens, `<|im_start|>system`, are every earlier prompt's too: read, to the token.)
    assert u.cache_creation_input_tokens >= 4 * BLOCK and u.cache_read_input_tokens < BLOCK, u
    again = client.messages.create(messages=[{"role": "user", "content": "And in Madrid, please?"}], **kw)
    v = again.usage
    assert v.cache_read_input_tokens >= u.cache_creation_input_tokens - BLOCK, (u, v)
    assert v.cache_read_input_tokens + v.cache_creation_input_tokens + v.input_tokens > 0
    assert total == client.messages.count_tokens(
        model=server.model(), system=system, tools=tools,
        messages=[{"role": "user", "content": "Weather in Paris?"}]).input_tokens


def test_a_format_beside_tools_the_model_may_call_gives_a_call_or_an_answer_in_it(server):
    c = server.client()
    model = server.model()
    answer = {"type": "object", "properties": {"reply": {"type": "string", "maxLength": 40}},
              "required": ["reply"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer, "strict": True}}
    seen = set()
    for user in ["Weather in Oslo?", "Say hello to me.", "What is two plus two?", "Weather in Rome?"]:
        for seed in range(3):
            r = c.chat.completions.create(model=model, messages=ask(user), tools=TOOLS, response_format=fmt,
                                          max_tokens=120, temperature=1, seed=seed)
            ch = r.choices[0]
            if ch.message.tool_calls:
                assert ch.finish_reason == "tool_calls", ch
                for call in ch.message.tool_calls:
                    assert call.function.name == "get_weather"
                    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
                seen.add("call")
            else:
                assert ch.finish_reason == "stop", ch
                jsonschema.validate(json.loads(ch.message.content), answer)
                seen.add("answer")
    # The grammar leaves the model both ways out (a format alone would never let it call).
    assert seen == {"call", "answer"}, seen
    # A format that is not JSON cannot be an answer beside calls: refused, named.
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers(),
                   json={"model": model, "messages": ask("Hi"), "tools": TOOLS, "max_tokens": 5,
                         "structured_outputs": {"regex": "[a-z]+"}})
    assert r.status_code == 400, r.text
    assert "tool_choice none" in r.json()["error"]["message"], r.text
    # Nor beside a forced call (a JSON format is taken there: it is for a later turn's answer).
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers(),
                       json={"model": model, "messages": ask("Hi"), "tools": TOOLS, "max_tokens": 5,
                             "tool_choice": choice, "structured_outputs": {"regex": "[a-z]+"}})
        assert r.status_code == 400 and "tool_choice none" in r.json()["error"]["message"], r.text
        r = c.chat.completions.create(model=model, messages=ask("Weather in Oslo?"), tools=TOOLS, tool_choice=choice,
                                      response_format=fmt, parallel_tool_calls=False, max_tokens=60, temperature=0)
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_strict_tools_the_model_may_call_are_called_only_with_valid_arguments(server):
    c = server.client()
    model = server.model()
    # A schema the model's own calls do not meet: a required key of a single value.
    strict_schema = {"type": "object", "additionalProperties": False, "required": ["city", "units"],
                     "properties": {"city": {"type": "string", "maxLength": 20}, "units": {"enum": ["si-metric"]}}}
    # The default model seldom calls a tool by itself: the tokens of a call are favoured, the same for
    # both runs below.
    favoured = server.tokenize('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    bias = {str(t): 5 for t in set(favoured)}

    def outcomes(strict: bool) -> list[str]:
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                                   "parameters": strict_schema, "strict": strict}}]
        out = []
        for seed in range(3):
            r = c.chat.completions.create(model=model, messages=ask("Weather in Oslo?"), tools=tools,
                                          max_tokens=60, temperature=1, seed=seed, logit_bias=bias)
            ch = r.choices[0]
            if not ch.message.tool_calls:
                out.append("answer")
            for call in ch.message.tool_calls or []:
                assert call.function.name == "get_weather"
                try:
                    jsonschema.validate(json.loads(call.function.arguments), strict_schema)
                    out.append("valid call")
                except (ValueError, jsonschema.ValidationError):
                    out.append("invalid call")
        return out

    strict = outcomes(True)
    # Strict: the model still answers or calls, and every call meets the schema.
    assert set(strict) == {"answer", "valid call"}, strict
    # Not strict, the same requests: no call the model writes meets it (the constraint did the work).
    assert "valid call" not in outcomes(False)
    # A turn that goes on from given text cannot start with the strict tools' grammar: refused, named.
    a = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0)
    strict_tool = {"name": "get_weather", "input_schema": strict_schema, "strict": True}
    with pytest.raises(anthropic.BadRequestError, match="strict tool"):
        a.messages.create(model=model, max_tokens=8, tools=[strict_tool],
                          messages=[{"role": "user", "content": "Weather in Oslo?"},
                                    {"role": "assistant", "content": "Let me"}])
    with pytest.raises(anthropic.BadRequestError, match="strict must be a boolean"):
        a.messages.create(model=model, max_tokens=8, tools=[strict_tool | {"strict": 1}],
                          messages=[{"role": "user", "content": "Weather in Oslo?"}])
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers(),
                   json={"model": model, "max_tokens": 5, "continue_final_message": True,
                         "add_generation_prompt": False, "tools": [{"type": "function", "function": {
                             "name": "get_weather", "parameters": strict_schema, "strict": True}}],
                         "messages": ask("Hi") + [{"role": "assistant", "content": "Let me"}]})
    assert r.status_code == 400 and "strict tool" in r.text, r.text
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers(),
                   json={"model": model, "messages": ask("Hi"), "max_tokens": 5,
                         "tools": [{"type": "function", "function": {"name": "w", "strict": "yes"}}]})
    assert r.status_code == 400 and "strict must be a boolean" in r.text, r.text


@pytest.mark.parametrize("content,needle", [
    (None, "no such file"),
    ("{% for %}", "does not compile"),
])
def test_a_template_file_that_cannot_be_used_stops_the_server_named(tmp_path, content, needle):
    path = tmp_path / "template.jinja"
    if content is not None:
        path.write_text(content)
    p = subprocess.run([kura_bin(), "serve", "--model", model_path(), "--port", "0", "--chat-template", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--chat-template" in p.stderr and str(path) in p.stderr, p.stderr
    assert needle in p.stderr.lower(), p.stderr
