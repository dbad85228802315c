"""Every bad input we could think of, with the status and the OpenAI-shaped error it gets. The table is
printed (run pytest with -s to see it) and each row asserts its status; the server must stay healthy."""

import json

import httpx

from conftest import KuraServer

OK_PROMPT = {"prompt": "Hello", "max_tokens": 2}


def cases(model: str, max_len: int):
    big = "word " * 20000
    c = "/v1/completions"
    ch = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    return [
        # (what, path, raw body or JSON, expected status)
        ("malformed JSON", c, b'{"prompt": "x", ', 400),
        ("empty body", c, b"", 400),
        ("body is a JSON array", c, b"[1, 2]", 400),
        ("missing prompt", c, {"model": model}, 400),
        ("prompt is a number", c, {"prompt": 5}, 400),
        ("prompt is an empty string", c, {"prompt": ""}, 400),
        ("empty list of prompts", c, {"prompt": []}, 400),
        ("300 prompts", c, {"prompt": ["a"] * 300}, 400),
        ("trailing garbage after the object", c, b'{"prompt": "x"} garbage', 400),
        ("two concatenated objects", c, b'{"prompt": "x"}{"prompt": "y"}', 400),
        ("trailing NUL byte", c, b'{"prompt": "x"}\x00', 400),
        ("token id outside the vocabulary", c, {"prompt": [1, 2, 99999999]}, 400),
        ("negative token id", c, {"prompt": [-1]}, 400),
        ("max_tokens is a string", c, {**OK_PROMPT, "max_tokens": "ten"}, 400),
        ("max_tokens 0", c, {**OK_PROMPT, "max_tokens": 0}, 400),
        ("max_tokens negative", c, {**OK_PROMPT, "max_tokens": -5}, 400),
        ("max_tokens 2^32", c, {**OK_PROMPT, "max_tokens": 2**32}, 400),
        ("prompt plus max_tokens beyond the context", c, {"prompt": "Hello", "max_tokens": max_len}, 400),
        ("temperature is a string", c, {**OK_PROMPT, "temperature": "hot"}, 400),
        ("temperature 5", c, {**OK_PROMPT, "temperature": 5}, 400),
        ("temperature just past 2", c, {**OK_PROMPT, "temperature": 2.0000001}, 400),
        ("top_p 0", c, {**OK_PROMPT, "top_p": 0}, 400),
        ("top_p 1.5", c, {**OK_PROMPT, "top_p": 1.5}, 400),
        ("top_k -7", c, {**OK_PROMPT, "top_k": -7}, 400),
        ("min_p 2", c, {**OK_PROMPT, "min_p": 2}, 400),
        ("n 0", c, {**OK_PROMPT, "n": 0}, 400),
        ("n 1000", c, {**OK_PROMPT, "n": 1000}, 400),
        ("presence_penalty 3", c, {**OK_PROMPT, "presence_penalty": 3}, 400),
        ("frequency_penalty -9", c, {**OK_PROMPT, "frequency_penalty": -9}, 400),
        ("stop is a number", c, {**OK_PROMPT, "stop": 3}, 400),
        ("empty stop string", c, {**OK_PROMPT, "stop": [""]}, 400),
        ("seventeen stop strings", c, {**OK_PROMPT, "stop": [str(i) for i in range(17)]}, 400),
        ("logprobs 50", c, {**OK_PROMPT, "logprobs": 50}, 400),
        ("echo with a saved context", c, {**OK_PROMPT, "echo": True, "cached_content": "cachedContents/x"}, 400),
        ("max_tokens 0 without echo", c, {**OK_PROMPT, "max_tokens": 0}, 400),
        ("best_of unlike n", c, {**OK_PROMPT, "best_of": 3}, 400),
        ("logit_bias of a token past the vocabulary", c, {**OK_PROMPT, "logit_bias": {"999999": 5}}, 400),
        ("logit_bias of 101", c, {**OK_PROMPT, "logit_bias": {"1": 101}}, 400),
        ("logit_bias key not a token id", c, {**OK_PROMPT, "logit_bias": {"one": 5}}, 400),
        ("stream_options without stream", c, {**OK_PROMPT, "stream_options": {"include_usage": True}}, 400),
        ("seed is a string", c, {**OK_PROMPT, "seed": "abc"}, 400),
        ("priority is a float", c, {**OK_PROMPT, "priority": 1.5}, 400),
        ("priority without --scheduling-policy priority", c, {**OK_PROMPT, "priority": -10}, 400),
        ("empty cache_salt", c, {**OK_PROMPT, "cache_salt": ""}, 400),
        ("cache_salt of 100 KB", c, {**OK_PROMPT, "cache_salt": "s" * 100_000}, 400),
        ("stop string of 100 KB", c, {**OK_PROMPT, "stop": ["z" * 100_000]}, 400),
        ("1,025 stop_token_ids", c, {**OK_PROMPT, "stop_token_ids": list(range(1025))}, 400),
        ("responses: service_tier not a tier", "/v1/responses", {"input": "x", "service_tier": "x" * 100_000}, 400),
        ("responses: metadata value of 600 characters", "/v1/responses",
         {"input": "x", "metadata": {"k": "v" * 600}}, 400),
        ("unknown model", c, {**OK_PROMPT, "model": "gpt-4"}, 404),
        ("missing messages", ch, {"model": model}, 400),
        ("empty messages", ch, {"messages": []}, 400),
        ("messages is a string", ch, {"messages": "hi"}, 400),
        ("unknown role", ch, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
        ("image content part", ch, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
        ("content is a number", ch, {"messages": [{"role": "user", "content": 7}]}, 400),
        ("a user message without content", ch, {"messages": [{"role": "user", "content": None}]}, 400),
        ("a system message without content", ch, {"messages": [{"role": "system"}, *msgs]}, 400),
        ("top_logprobs without logprobs", ch, {"messages": msgs, "top_logprobs": 2}, 400),
        ("max_completion_tokens 0", ch, {"messages": msgs, "max_completion_tokens": 0}, 400),
        ("chat prompt beyond the context", ch, {"messages": [{"role": "user", "content": big}]}, 400),
        ("body over the size limit", c, {"prompt": "x" * 300_000}, 413),
        ("unknown route", "/v1/embeddings", {"input": "x"}, 404),
        ("tokenize: a field it does not take", "/tokenize", {"prompt": "x", "return_token_strs": True}, 400),
        ("tokenize: add_special_tokens with messages", "/tokenize", {"messages": msgs, "add_special_tokens": True}, 400),
        ("tokenize: add_generation_prompt false", "/tokenize", {"messages": msgs, "add_generation_prompt": False}, 400),
        ("tokenize: tools with a prompt", "/tokenize", {"prompt": "x", "tools": []}, 400),
        ("tokenize: unknown model", "/tokenize", {"prompt": "x", "model": "gpt-4"}, 404),
        ("responses: text is a string", "/v1/responses", {"input": "x", "text": "x"}, 400),
        ("chat: service_tier a number", ch, {"messages": msgs, "service_tier": 123}, 400),
        ("responses: reasoning with an unknown field", "/v1/responses", {"input": "x", "reasoning": {"a": 1}}, 400),
        ("caches: a message without a string role", "/v1/caches", {"messages": [{"role": None, "content": "x"}]}, 400),
    ]


def test_bad_inputs_get_clear_errors(capsys):
    s = KuraServer("--kv-cache-memory", "64MiB", "--max-body-size", "256KiB")
    try:
        model = s.model()
        max_len = httpx.post(s.url + "/tokenize", json={"prompt": "x"}).json()["max_model_len"]
        rows = []
        for what, path, body, want in cases(model, max_len):
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = httpx.post(s.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
            try:
                err = r.json()["error"]
                message = err["message"]
                assert err["type"] and "code" in err and "param" in err
            except (ValueError, KeyError, TypeError):
                message = f"<not an OpenAI error body: {r.text[:80]!r}>"
            rows.append((what, r.status_code, want, message))
        with capsys.disabled():
            print("\n| bad input | status | message |\n|---|---|---|")
            for what, status, _, message in rows:
                print(f"| {what} | {status} | {message} |")
        for what, status, want, message in rows:
            assert status == want, f"{what}: got {status}, want {want}: {message}"
            assert not message.startswith("<not"), f"{what}: {message}"
        r = httpx.get(s.url + "/v1/completions")
        assert r.status_code == 405 and "method not allowed" in r.json()["error"]["message"]
        # A page's "simple" cross-origin POST (no preflight) cannot drive the server: JSON routes take
        # only application/json.
        for ctype in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]:
            r = httpx.post(s.url + "/v1/completions", content=json.dumps(OK_PROMPT), headers={"content-type": ctype})
            assert r.status_code == 415, (ctype, r.text)
            assert "application/json" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/completions", content=json.dumps(OK_PROMPT))
        assert r.status_code == 415, r.text
        # Wrong key handling needs keys; the server is still healthy after all of the above.
        assert httpx.get(s.url + "/health").status_code == 200
        ok = httpx.post(s.url + "/v1/completions", json=OK_PROMPT)
        assert ok.status_code == 200
    finally:
        s.stop()


def test_bad_api_keys_get_401():
    s = KuraServer("--kv-cache-memory", "32MiB", "--api-key", "key-one", api_key="key-one")
    try:
        for header in [None, "Bearer nope", "Basic a2V5LW9uZQ==", "Bearer", "Bearer key-one-and-more"]:
            headers = {"authorization": header} if header else {}
            r = httpx.post(s.url + "/v1/completions", json=OK_PROMPT, headers=headers)
            assert r.status_code == 401, header
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(s.url + "/v1/completions", json=OK_PROMPT, headers=s.headers()).status_code == 200
    finally:
        s.stop()


def test_messages_name_the_field_and_tokenize_counts_what_chat_sends():
    s = KuraServer("--kv-cache-memory", "64MiB")
    try:
        post = lambda path, body, **kw: httpx.post(s.url + path, json=body, timeout=60, **kw)  # noqa: E731
        msgs = [{"role": "user", "content": "Weather in Oslo?"}]
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                                   "parameters": {"type": "object", "properties": {
                                                       "city": {"type": "string"}}}}}]
        bare = post("/tokenize", {"messages": msgs}).json()["count"]
        with_tools = post("/tokenize", {"messages": msgs, "tools": tools}).json()["count"]
        chat = post("/v1/chat/completions", {"messages": msgs, "tools": tools, "max_tokens": 1}).json()
        assert with_tools == chat["usage"]["prompt_tokens"] > bare, (bare, with_tools, chat["usage"])
        r = post("/tokenize", {"prompt": [1, 2, 3]})
        assert r.status_code == 400 and "expected a string" in r.json()["error"]["message"], r.text
        for body in ({"prompt": "hi", "messages": msgs}, {}):
            r = post("/tokenize", body)
            assert r.status_code == 400 and "exactly one of prompt" in r.json()["error"]["message"], r.text
        r = post("/v1/caches", {"messages": [{"role": None, "content": "x"}]})
        assert "messages[0].role" in r.json()["error"]["message"], r.text
        for method in (httpx.get, httpx.delete):
            r = method(s.url + "/v1/responses/resp_nope")
            assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
        r = httpx.post(s.url + "/v1/completions", content=json.dumps(OK_PROMPT),
                       headers={"content-type": "application/json", "content-encoding": "gzip"})
        assert r.status_code == 415 and "gzip" in r.json()["error"]["message"], r.text
        # A text longer than the context could hold whatever it says is refused before it is tokenized
        # (a million-token body held a gigabyte for a moment to be refused); chat counts the rendered text.
        for path, body, param in [
                ("/v1/completions", {"prompt": "hello world " * 300_000, "max_tokens": 1}, "prompt"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 100_000}, "messages"),
                ("/v1/responses", {"input": "hello world " * 300_000}, "input")]:
            r = post(path, body)
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "context_length_exceeded", (path, r.text)
            assert err["message"].startswith("the text is longer than the context could hold: "), (path, r.text)
            assert err["param"] == param, (path, r.text)
        # A path id that is not UTF-8 gets the JSON error shape, like every other error.
        for method, path in [(httpx.get, "/v1/models/%ff"), (httpx.get, "/v1/responses/%ff%fe"),
                             (httpx.delete, "/v1/caches/%c3")]:
            r = method(s.url + path)
            assert r.status_code == 400, (path, r.text)
            assert "the id in the path" in r.json()["error"]["message"], (path, r.text)
        # The Responses API's errors use its own names: input[i] and call_id, max_output_tokens.
        r = post("/v1/responses", {"input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"type": "function_call_output", "call_id": "c9", "output": "?"}], "max_output_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "input", r.text
        assert err["message"].startswith('input[3] answers call_id "c9", which no earlier function_call'), r.text
        max_len = post("/tokenize", {"prompt": "x"}).json()["max_model_len"]
        r = post("/v1/responses", {"input": "Hello", "max_output_tokens": max_len})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
        assert err["param"] == "max_output_tokens" and "max_output_tokens asks for" in err["message"], r.text
        assert "max_tokens" not in err["message"].replace("max_output_tokens", ""), r.text
    finally:
        s.stop()
