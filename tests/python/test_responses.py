"""OpenAI's Responses API through the official `openai` client (`client.responses`) against a real
`kura serve`: a five-turn conversation over `previous_response_id` whose every turn reuses the previous
turn's KV, the documented stream events, function tools and `function_call_output`, `text.format`,
`GET`/`DELETE` of stored responses, and stored responses kept apart by tenant.
"""

import json

import httpx
import jsonschema
import openai
import pytest

from conftest import BLOCK, KuraServer

KEY_A = "sk-responses-tenant-a"
KEY_B = "sk-responses-tenant-b"
INSTRUCTIONS = "You are a concise assistant. Answer in one sentence. " * 8
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    s = KuraServer("--api-key", KEY_A, "--api-key", KEY_B, "--kv-cache-memory", "256MiB", api_key=KEY_A)
    yield s
    s.stop()


def test_five_turns_each_reuse_the_previous_turn(server):
    c = server.client()
    model = server.model()
    questions = ["Name a colour.", "Name a fruit of that colour.", "Where does it grow?",
                 "Name an animal that eats it.", "Summarize our talk."]
    previous = None
    for i, q in enumerate(questions):
        r = c.responses.create(model=model, instructions=INSTRUCTIONS, input=q, previous_response_id=previous,
                               max_output_tokens=24, temperature=0)
        assert r.object == "response" and r.status in ("completed", "incomplete"), r
        assert r.output[0].type == "message" and r.output_text, r
        if previous is not None:
            cached = r.usage.input_tokens_details.cached_tokens
            assert cached >= prev_prompt - BLOCK, (i, cached, prev_prompt)
            # The conversation grew by the previous output and this input.
            assert r.usage.input_tokens > prev_prompt + prev_output
        prev_prompt, prev_output = r.usage.input_tokens, r.usage.output_tokens
        assert r.previous_response_id == previous
        previous = r.id
    # The stored response reads back whole.
    got = c.responses.retrieve(previous)
    assert got.id == previous and got.output_text == r.output_text


def test_streamed_events_come_in_the_documented_order(server):
    c = server.client()
    model = server.model()
    whole = c.responses.create(model=model, input="Say something about rivers.", max_output_tokens=20,
                               temperature=0, store=False)
    events = list(c.responses.create(model=model, input="Say something about rivers.", max_output_tokens=20,
                                     temperature=0, store=False, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    # store: false keeps nothing.
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(whole.id)


def test_function_calls_and_their_outputs_continue_from_the_cache(server):
    c = server.client()
    model = server.model()
    first = c.responses.create(model=model, instructions=INSTRUCTIONS, input="What is the weather in Oslo?",
                               tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                               max_output_tokens=120, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1, first.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    second = c.responses.create(model=model, instructions=INSTRUCTIONS, previous_response_id=first.id,
                                tools=[WEATHER], max_output_tokens=20, temperature=0,
                                input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                        "output": "4 degrees, snow"}])
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - BLOCK, second.usage
    # A function tool that does not say is strict, as Responses defines it; one that says false is not.
    assert [t.strict for t in second.tools] == [True], second.tools
    loose = c.responses.create(model=model, input="Hi", tools=[WEATHER | {"strict": False}], max_output_tokens=2,
                               store=False)
    assert [t.strict for t in loose.tools] == [False], loose.tools
    # Streamed calls: the arguments arrive as deltas and add up to the call.
    events = list(c.responses.create(model=model, input="Weather in Bergen?", tools=[WEATHER], store=False,
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     parallel_tool_calls=False, max_output_tokens=120, temperature=0,
                                     stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == args
    jsonschema.validate(json.loads(args), WEATHER["parameters"])


def test_a_stored_response_in_progress_can_be_read_and_deleted(server):
    """While a stored response is generated (a long prompt's prefill), GET shows it in progress, it is
    no `previous_response_id` yet, and DELETE holds: it is not kept when it completes."""
    c = server.client()
    long_prompt = "Describe the harbor, the river and the stones. " * 160
    stream = c.responses.create(model=server.model(), input=long_prompt, max_output_tokens=300,
                                temperature=0, stream=True)
    events = iter(stream)
    created = next(events)
    assert created.type == "response.created", created
    rid = created.response.id
    seen = c.responses.retrieve(rid)
    assert seen.status == "in_progress" and seen.id == rid, seen
    with pytest.raises(openai.BadRequestError, match="still in progress"):
        c.responses.create(model=server.model(), input="And then?", previous_response_id=rid,
                           max_output_tokens=1)
    c.responses.delete(rid)
    # Another tenant does not see it.
    other = server.client(KEY_B)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(rid)
    rest = [e.type for e in events]
    assert rest[-1] in ("response.completed", "response.incomplete"), rest[-3:]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(rid)


def test_a_tool_whose_parameters_admit_no_value_fails_by_name(server):
    """A schema that only refers to itself compiles (the call's opening can start), then no token can
    go on: the request fails naming the problem, streamed as `response.failed` with the error's own
    code, not a server error, and as a 400 whole."""
    c = server.client()
    selfish = {"type": "function", "name": "loop", "parameters": {"$ref": "#"}}
    kw = dict(model=server.model(), input="Call it.", tools=[selfish], tool_choice="required", store=False,
              max_output_tokens=40, temperature=0)
    events = list(c.responses.create(stream=True, **kw))
    failed = [e for e in events if e.type == "response.failed"]
    assert failed and failed[0].response.error.code == "invalid_request_error", events[-1]
    assert "no token can continue the output here" in failed[0].response.error.message
    with pytest.raises(openai.BadRequestError, match="admits no value"):
        c.responses.create(**kw)


def test_text_format_json_schema(server):
    c = server.client()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["name", "legs"], "additionalProperties": False}
    r = c.responses.create(model=server.model(), input="An animal as JSON.", max_output_tokens=80, temperature=0,
                           text={"format": {"type": "json_schema", "name": "animal", "schema": schema,
                                            "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)


def test_stored_responses_belong_to_their_tenant(server):
    a = server.client()
    b = server.client(api_key=KEY_B)
    model = server.model()
    r = a.responses.create(model=model, input="Hello.", max_output_tokens=5, temperature=0)
    assert a.responses.retrieve(r.id).id == r.id
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        b.responses.create(model=model, input="Go on.", previous_response_id=r.id, max_output_tokens=5)
    assert e.value.response.json()["error"]["param"] == "previous_response_id"
    # The answer is the same as for an id nobody has: nothing tells B that A's exists.
    with pytest.raises(openai.BadRequestError) as e2:
        b.responses.create(model=model, input="Go on.", previous_response_id="resp_nobody", max_output_tokens=5)
    assert e.value.response.json()["error"]["message"].replace(r.id, "X") == \
        e2.value.response.json()["error"]["message"].replace("resp_nobody", "X")
    a.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r.id)



def test_input_tokens_count_is_the_prompt_responses_computes(server):
    """`responses.input_tokens.count` counts what `/v1/responses` computes for the same input,
    instructions, tools and previous response (its `usage.input_tokens`), and finds another tenant's
    previous response no more than `create` does."""
    a = server.client()
    model = server.model()
    first = a.responses.create(model=model, instructions=INSTRUCTIONS, input="Name a river.", max_output_tokens=8,
                               temperature=0)
    cases = [
        dict(input="Name a mountain."),
        dict(input="Name a mountain.", instructions=INSTRUCTIONS),
        dict(input="Weather in Bern?", instructions=INSTRUCTIONS, tools=[WEATHER], tool_choice="required"),
        dict(input=[{"role": "user", "content": "Go on."}], instructions=INSTRUCTIONS, previous_response_id=first.id),
    ]
    counts = []
    for case in cases:
        n = a.responses.input_tokens.count(model=model, **case)
        assert n.object == "response.input_tokens", n
        r = a.responses.create(model=model, max_output_tokens=1, temperature=0, store=False, **case)
        assert n.input_tokens == r.usage.input_tokens, (case, n, r.usage)
        counts.append(n.input_tokens)
    assert counts[0] < counts[1] < counts[2], counts
    assert counts[3] > first.usage.input_tokens + first.usage.output_tokens, (counts, first.usage)
    # `model` may be left out.
    assert a.responses.input_tokens.count(input="Name a mountain.").input_tokens == counts[0]
    b = server.client(api_key=KEY_B)
    with pytest.raises(openai.BadRequestError) as e:
        b.responses.input_tokens.count(model=model, input="Go on.", previous_response_id=first.id)
    assert e.value.response.json()["error"]["param"] == "previous_response_id"
    for extra, words in [({"max_output_tokens": 5}, "max_output_tokens is not a field of input_tokens"),
                         ({"reasoning": {"effort": "high"}}, "no reasoning mode"),
                         ({"model": "other-model"}, "other-model")]:
        r = httpx.post(server.url + "/v1/responses/input_tokens", json={"input": "x", **extra},
                       headers=server.headers())
        assert r.status_code in (400, 404), r.text
        assert words in r.json()["error"]["message"], r.text

BAD = [
    ({"input": "x", "previous_response_id": "resp_unknown"}, 400, "previous_response_id", "was not found"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation", "disabled"),
    ({"input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning", "no reasoning mode"),
    ({"input": "x", "background": True}, 400, "background", "background"),
    ({"input": "x", "cached_content": "ctx_1"}, 400, "cached_content", "saved contexts go with"),
    ({"input": "x", "tools": [{"type": "web_search_preview"}]}, 400, "tools", "function tools only"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input", "input_image"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input",
     "only text"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]}, 400, "input",
     "input[0] answers call_id \"call_9\", which no earlier function_call"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "integer",
                                                                                      "minimum": 3, "maximum": 1}}}},
     400, "text", "could not be compiled"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", "at least 1"),
    ({}, 400, "input", "input is required"),
]


@pytest.mark.parametrize("body,status,param,words", BAD)
def test_bad_responses_requests_name_the_problem(server, body, status, param, words):
    r = httpx.post(server.url + "/v1/responses", json={"model": server.model(), **body}, headers=server.headers())
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"], err
