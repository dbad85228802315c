"""A reasoning model's `<think>…</think>` text read apart from its answer (vLLM's
`--reasoning-parser`): chat's `reasoning_content` (and `reasoning`), a Responses `reasoning` item, a
Messages `thinking` block, streamed and whole, through the official `openai` and `anthropic` clients.

No reasoning model is small enough to fetch for the suite, so the default model is shown reasoning
turns: with a few earlier turns of `<think>…</think>` then an answer, it writes its own that way.
`kura serve --chat-template` gives it a template that spells `<think>` (Qwen3's way: `enable_thinking`
false closes an empty think block after the generation prompt), which turns the parser on (`auto`);
a second server with `--reasoning-parser none` writes the same text whole, to compare against.
"""

import json
import os
import re

import anthropic
import pytest

from conftest import KuraServer

TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "thinking.jinja")

SHOTS = [
    ("What is 2+2?", "<think>\nTwo plus two is four.\n</think>\n\nThe answer is 4."),
    ("What is the capital of Italy?", "<think>\nItaly's capital is Rome.\n</think>\n\nThe capital of Italy is Rome."),
]


def turns(question: str) -> list[dict]:
    out = []
    for q, a in SHOTS:
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return out + [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def servers():
    reading = KuraServer("--kv-cache-memory", "128MiB", "--chat-template", TEMPLATE)
    raw = KuraServer("--kv-cache-memory", "128MiB", "--chat-template", TEMPLATE, "--reasoning-parser", "none")
    yield reading, raw
    reading.stop()
    raw.stop()


def whole_text(server: KuraServer, messages: list[dict], **extra) -> str:
    r = server.client().chat.completions.create(model=server.model(), messages=messages, max_tokens=60,
                                                temperature=0, **extra)
    return r.choices[0].message.content


def test_chat_reads_the_reasoning_apart_whole_and_streamed(servers):
    reading, raw = servers
    c, model = reading.client(), reading.model()
    messages = turns("What is the capital of France?")
    # The text as the model writes it: a reasoning block, then the answer.
    text = whole_text(raw, messages)
    m = re.fullmatch(r"<think>\s*(.*?)\s*</think>\s*(.*)", text, re.S)
    assert m, text
    reasoning, answer = m.group(1), m.group(2)
    assert reasoning and answer, text
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == (reasoning, answer), msg
    assert msg.model_extra["reasoning"] == reasoning
    assert r.choices[0].finish_reason == "stop"
    # The usage says how many of the completion's tokens reasoned (`<think>` to `</think>`).
    spent = r.usage.completion_tokens_details.reasoning_tokens
    assert len(reading.tokenize(reasoning)) < spent < r.usage.completion_tokens, r.usage
    # Streamed: the pieces of each add up to the same.
    pieces = {"reasoning_content": "", "reasoning": "", "content": ""}
    for chunk in c.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            assert chunk.usage.completion_tokens_details.reasoning_tokens == spent
        if chunk.choices:
            d = chunk.choices[0].delta
            pieces["content"] += d.content or ""
            for name in ("reasoning_content", "reasoning"):
                pieces[name] += (d.model_extra or {}).get(name) or ""
    assert pieces == {"reasoning_content": reasoning, "reasoning": reasoning, "content": answer}, pieces
    # A prefilled reasoning (the prompt ends inside `<think>`, as R1's template writes it): the output
    # starts inside the reasoning.
    prefill = messages + [{"role": "assistant", "content": "<think>\n"}]
    cont = dict(extra_body={"continue_final_message": True, "add_generation_prompt": False})
    raw_cont = whole_text(raw, prefill, **cont)
    assert "</think>" in raw_cont and not raw_cont.startswith("<think>"), raw_cont
    r = c.chat.completions.create(model=model, messages=prefill, max_tokens=60, temperature=0, **cont)
    before, _, after = raw_cont.partition("</think>")
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == \
        (before.strip(), after.lstrip()), r.choices[0].message
    # Cut off while it reasons: all of it is reasoning, and the answer is null.
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and msg.content is None and msg.reasoning_content, msg


def test_an_answer_with_no_reasoning_is_the_text_as_written(servers):
    reading, raw = servers
    # Thinking off: the template closes an empty block in the prompt, and the answer is the text.
    off = dict(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    messages = [{"role": "user", "content": "Say hello."}]
    expected = whole_text(raw, messages, **off)
    assert "<think>" not in expected
    r = reading.client().chat.completions.create(model=reading.model(), messages=messages, max_tokens=60,
                                                 temperature=0, **off)
    msg = r.choices[0].message
    assert msg.content == expected, msg
    assert not {"reasoning", "reasoning_content"} & set(msg.model_extra or {}), msg
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_the_default_template_reads_no_reasoning(server):
    # The default model's own template spells no `<think>`: a `<think>` it writes is its answer's text.
    r = server.client().chat.completions.create(model=server.model(), messages=turns("What is 3+3?"),
                                                max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert msg.content.startswith("<think>"), msg
    assert not {"reasoning", "reasoning_content"} & set(msg.model_extra or {}), msg
    assert r.usage.completion_tokens_details is None
    # And Anthropic's thinking is refused there, naming it.
    a = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="thinking is not supported"):
        a.messages.create(model=server.model(), max_tokens=2048, messages=[{"role": "user", "content": "Hi"}],
                          thinking={"type": "enabled", "budget_tokens": 1024})


def test_responses_put_the_reasoning_in_its_own_item(servers):
    reading, raw = servers
    c, model = reading.client(), reading.model()
    messages = turns("What is the capital of France?")
    m = re.fullmatch(r"<think>\s*(.*?)\s*</think>\s*(.*)", whole_text(raw, messages), re.S)
    reasoning, answer = m.group(1), m.group(2)
    r = c.responses.create(model=model, input=messages, max_output_tokens=60, temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"], r.output
    assert [p.text for p in r.output[0].content] == [reasoning] and r.output[0].summary == []
    assert r.output_text == answer
    chat = c.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0)
    spent = r.usage.output_tokens_details.reasoning_tokens
    assert spent == chat.usage.completion_tokens_details.reasoning_tokens > 0
    # Streamed: the reasoning's deltas, then the answer's; the final response is the same.
    events = list(c.responses.create(model=model, input=messages, max_output_tokens=60, temperature=0,
                                     stream=True, store=False))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta"), kinds
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["reasoning", "message"]
    final = events[-1].response
    assert final.output_text == answer and final.output[0].content[0].text == reasoning
    assert final.usage.output_tokens_details.reasoning_tokens == spent
    # The next turn sends the output back, reasoning item and all (as a client replays it): taken, and
    # left out of the prompt; so is the stored turn its previous_response_id continues from.
    follow = [{"role": "user", "content": "And of Spain?"}]
    replayed = c.responses.create(model=model, input=messages + [o.model_dump(exclude_none=True) for o in r.output]
                                  + follow, max_output_tokens=60, temperature=0, store=False)
    chained = c.responses.create(model=model, previous_response_id=r.id, input=follow, max_output_tokens=60,
                                 temperature=0, store=False)
    assert replayed.output_text == chained.output_text and replayed.output_text, replayed.output_text


def test_messages_answer_thinking_blocks_when_thinking_is_enabled(servers):
    reading, raw = servers
    a = anthropic.Anthropic(base_url=reading.url, api_key=reading.api_key, max_retries=0)
    messages = turns("What is the capital of France?")
    m = re.fullmatch(r"<think>\s*(.*?)\s*</think>\s*(.*)", whole_text(raw, messages), re.S)
    reasoning, answer = m.group(1), m.group(2)
    kw = dict(model=reading.model(), max_tokens=2048, extra_body={"temperature": 0}, messages=messages)
    shown = a.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    assert [b.type for b in shown.content] == ["thinking", "text"], shown.content
    assert shown.content[0].thinking == reasoning and shown.content[1].text == answer
    # Not enabled: the answer alone.
    hidden = a.messages.create(**kw)
    assert [b.type for b in hidden.content] == ["text"] and hidden.content[0].text == shown.content[1].text
    # Streamed: a thinking block's deltas, then the text's.
    with a.messages.stream(thinking={"type": "enabled", "budget_tokens": 1024}, **kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == reasoning and final.content[1].text == shown.content[1].text
    assert kinds.count("content_block_start") == 2, kinds
    # The turn sent back with its thinking block: taken, and left out of the prompt.
    again = a.messages.create(**(kw | {"messages": messages + [
        {"role": "assistant", "content": [b.model_dump() for b in shown.content]},
        {"role": "user", "content": "And of Spain?"}]}))
    plain = a.messages.create(**(kw | {"messages": messages + [
        {"role": "assistant", "content": shown.content[1].text},
        {"role": "user", "content": "And of Spain?"}]}))
    assert again.content[-1].text == plain.content[-1].text


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}


def test_a_format_or_a_forced_call_holds_the_answer_after_the_reasoning(servers):
    # As vLLM's reasoning-aware structured outputs: the model reasons freely, then the format holds.
    reading, raw = servers
    c, model = reading.client(), reading.model()
    messages = turns("What is the capital of France?")
    kw = dict(model=model, messages=messages, temperature=0, response_format=CITY_FORMAT)
    r = c.chat.completions.create(max_tokens=80, **kw)
    msg = r.choices[0].message
    assert msg.reasoning_content and json.loads(msg.content).keys() == {"city"}, msg
    assert r.choices[0].finish_reason == "stop"
    # Streamed: the same pieces.
    reasoning = content = ""
    for chunk in c.chat.completions.create(max_tokens=80, stream=True, **kw):
        if chunk.choices:
            d = chunk.choices[0].delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
    assert (reasoning, content) == (msg.reasoning_content, msg.content)
    # Cut short: the grammar closes the reasoning and the shortest answer in time, so it parses.
    for budget in (12, 16, 20):
        short = c.chat.completions.create(max_tokens=budget, **kw)
        assert json.loads(short.choices[0].message.content).keys() == {"city"}, (budget, short)
        assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens <= budget
    # Without the reasoning read (the parser off), the format holds the output from its first token.
    plain = raw.client().chat.completions.create(max_tokens=80, **(kw | {"model": raw.model()}))
    assert json.loads(plain.choices[0].message.content).keys() == {"city"}
    # A forced call: reasoning, then the call.
    tools = [{"type": "function", "function": {"name": "capital", "parameters": CITY}}]
    r = c.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=80, tools=tools,
                                  tool_choice="required")
    msg = r.choices[0].message
    assert msg.reasoning_content and msg.content is None, msg
    assert [t.function.name for t in msg.tool_calls] == ["capital"]
    assert json.loads(msg.tool_calls[0].function.arguments).keys() == {"city"}
    # Responses: the reasoning item, then the formatted message.
    out = c.responses.create(model=model, input=messages, max_output_tokens=80, temperature=0, store=False,
                             text={"format": {"type": "json_schema", "name": "city", "schema": CITY,
                                              "strict": True}})
    assert [o.type for o in out.output] == ["reasoning", "message"]
    assert json.loads(out.output_text).keys() == {"city"}


def test_a_thinking_budget_closes_the_reasoning_and_the_model_answers(servers):
    # Anthropic's `thinking.budget_tokens`: once the reasoning has that many tokens, `</think>` is
    # written in its place and the model answers. A prefilled count would otherwise run to max_tokens.
    reading, _ = servers
    a = anthropic.Anthropic(base_url=reading.url, api_key=reading.api_key, max_retries=0)
    messages = turns("Count from 1 to 2000.") + [
        {"role": "assistant", "content": "<think>\nLet me count: 1, 2, 3,"}]
    r = a.messages.create(model=reading.model(), max_tokens=1100, messages=messages,
                          thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0})
    assert [b.type for b in r.content] == ["thinking", "text"], r.content
    spent = len(reading.tokenize(r.content[0].thinking))
    assert 1000 <= spent <= 1030, spent
    assert r.content[1].text and r.usage.output_tokens < 1100, r
