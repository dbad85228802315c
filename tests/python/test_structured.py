"""Structured outputs through the official `openai` client against a real `kura serve`: JSON schemas,
JSON objects, regexes and choices enforced by llguidance masks in the sampler, greedy and sampled, batched
and with n > 1, on chat and completions, streamed and not; grammars llguidance refuses are a 400 naming
the problem.

A grammar guarantees the shape of every output, also one the token budget cuts: near the end of its
`max_tokens`, a choice whose grammar could no longer be closed in what is left takes the shortest way to
close it (a quote, the required fields' smallest values, the brackets), and ends as `"length"`. A small
model decoding greedily can repeat inside an unbounded string or number until then; the schema test
counts those.
"""

import concurrent.futures as cf
import json
import re

import httpx
import jsonschema
import openai
import pytest

from conftest import KuraServer
from schemas import schemas

SCHEMAS = schemas()


@pytest.fixture(scope="module")
def server():
    s = KuraServer("--kv-cache-memory", "256MiB")
    yield s
    s.stop()


def schema_runs(server: KuraServer, max_tokens: int = 400,
                plan: list[tuple[int, float, int]] | None = None) -> list[tuple[int, float, int, str, str]]:
    """Every schema greedy and at temperature 1 (the latter with n = 2), or the (schema, temperature, n)
    of `plan`, eight requests at a time (so that steps batch constrained choices): (schema, temperature,
    choice, finish reason, text)."""
    c = server.client()
    model = server.model()
    if plan is None:
        plan = [(i, t, 1 if t == 0 else 2) for i in range(len(SCHEMAS)) for t in (0.0, 1.0)]

    def one(i: int, temperature: float, n: int):
        r = c.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Fill in this form as JSON."}],
            max_tokens=max_tokens,
            temperature=temperature,
            seed=i,
            n=n,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"form_{i}", "schema": SCHEMAS[i], "strict": True}},
        )
        return [(i, temperature, ch.index, ch.finish_reason, ch.message.content) for ch in r.choices]

    with cf.ThreadPoolExecutor(8) as ex:
        runs = ex.map(lambda a: one(*a), plan)
        return [x for run in runs for x in run]


def validate(runs) -> None:
    """Every output, whatever its finish reason, is JSON valid under its schema."""
    for i, temperature, choice, reason, text in runs:
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[i])
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(
                f"schema {i} at temperature {temperature} choice {choice} ({reason}): {e}\n{text}") from e


def check_schema_runs(runs) -> None:
    validate(runs)
    stopped = [r for r in runs if r[3] == "stop"]
    cut = [r for r in runs if r[3] != "stop"]
    assert all(r[3] == "length" for r in cut), cut
    print(f"{len(runs)} of {len(runs)} outputs validate: {len(stopped)} ended by themselves, "
          f"{len(cut)} were closed at max_tokens")
    assert len(stopped) >= 0.9 * len(runs), f"only {len(stopped)} of {len(runs)} outputs ended by themselves"


def test_a_budget_too_small_for_the_model_still_gives_valid_json(server):
    """At max_tokens 40, many of the fifty schemas' outputs reach the limit: each is closed, and validates."""
    runs = schema_runs(server, max_tokens=40)
    validate(runs)
    cut = [r for r in runs if r[3] == "length"]
    print(f"{len(runs)} outputs validate at max_tokens 40, {len(cut)} of them closed at the limit")
    assert len(cut) >= 15, f"only {len(cut)} outputs reached the limit: the closing was hardly tried"


def test_fifty_json_schemas_greedy_and_sampled_validate(server):
    check_schema_runs(schema_runs(server))


def test_json_object_regex_and_choice(server):
    c = server.client()
    model = server.model()
    r = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give a JSON object with the keys name and age of a cat."}],
        max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # vLLM's spellings of the other guides.
    r = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A phone number?"}], max_tokens=20, temperature=1,
        seed=3, n=3, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    for ch in r.choices:
        assert re.fullmatch("[0-9]{3}-[0-9]{4}", ch.message.content), ch
    r = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=10, temperature=0,
        extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert r.choices[0].message.content in ("yes", "no", "it depends")
    assert r.choices[0].finish_reason == "stop"
    # The legacy completions endpoint takes the same fields, for each of several prompts.
    r = c.completions.create(
        model=model, prompt=["A JSON list of three numbers:", "Another one:"], max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"},
                                                    "minItems": 3, "maxItems": 3}}})
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch
        v = json.loads(ch.text)
        assert len(v) == 3 and all(isinstance(x, int) for x in v)


def test_streamed_structured_output_equals_the_whole_one(server):
    c = server.client()
    model = server.model()
    kw = dict(model=model, messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=120,
              temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[1]}})
    whole = c.chat.completions.create(**kw).choices[0].message.content
    parts, finish = [], None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(parts) == whole
    assert finish == "stop"
    jsonschema.validate(json.loads(whole), SCHEMAS[1])


def test_a_grammar_the_server_cannot_compile_is_a_400_that_names_it(server):
    c = server.client()
    model = server.model()
    for fmt, words in [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"$ref": "#/$defs/missing"}}}}}, "missing"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5,
                                                                         "maximum": 1}}}, "response_format"),
        ({"type": "xml"}, "xml"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                      max_tokens=5, response_format=fmt)
        body = e.value.response.json()["error"]
        assert body["param"] == "response_format", body
        assert words in body["message"], body
    for field, value, words in [
        ("guided_regex", "[^\\s\\S]", "matches no text"),
        ("guided_choice", [f"word{i}" for i in range(120_000)], "at most 1048576 (1 MiB)"),
    ]:
        r = httpx.post(server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, field: value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text
        assert words in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
        "structured_outputs": {"grammar": "start: ( unclosed"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs", r.text
    assert "could not be compiled" in r.json()["error"]["message"], r.text


def test_characters_of_several_bytes_that_a_grammar_forces_come_out_whole(server):
    """A grammar that forces part of a character (an emoji's first bytes) forces the tokens that spell
    those bytes: the output is the character, and the choice ends by itself, also on a small budget."""
    c = server.client()
    model = server.model()
    for max_tokens in (100, 12):
        r = c.completions.create(model=model, prompt="x", max_tokens=max_tokens, temperature=0,
                                 extra_body={"guided_choice": ["😀"]})
        assert (r.choices[0].text, r.choices[0].finish_reason) == ("😀", "stop"), r
        r = c.completions.create(model=model, prompt="x", max_tokens=max_tokens, temperature=0,
                                 extra_body={"guided_choice": ["中国", "日本x"]})
        assert r.choices[0].text in ("中国", "日本x") and r.choices[0].finish_reason == "stop", r
    for seed in range(4):
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Pick."}], max_tokens=40,
                                      temperature=1, seed=seed, extra_body={"guided_regex": "[à-ÿ]{3}|[😀-😂]"})
        assert re.fullmatch("[à-ÿ]{3}|[😀-😂]", r.choices[0].message.content), r
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Pick."}], max_tokens=40,
                                      temperature=1, seed=seed, response_format={
                                          "type": "json_schema", "json_schema": {"name": "e", "schema": {
                                              "enum": ["😀", "ünïcödé", "中国"]}}})
        assert json.loads(r.choices[0].message.content) in ("😀", "ünïcödé", "中国"), r


def test_a_grammar_past_llguidances_limits_while_generating_is_a_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "guided_regex": "a{1000000}"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "grammar" in message and "\n" not in message, message
