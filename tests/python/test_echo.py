"""`echo` on /v1/completions, through the official `openai` client and the real model: each choice's text
starts with its prompt, and with `logprobs` the prompt's tokens are scored too (the first with `null`), as
lm-evaluation-harness's log-likelihood tasks ask (`echo`, `logprobs` 1, `max_tokens` 1, token prompts) and
read (`token_logprobs[ctxlen:-1]`, greedy when each token's logprob is the top one's). And vLLM's
`prompt_logprobs` on completions and chat (each prompt token's logprob, rank and alternatives, as
distillation teachers read them)."""

import httpx

from conftest import long_text


def generate(client, model, tokens, n):
    """`n` greedy tokens after `tokens`, with their logprobs."""
    c = client.completions.create(model=model, prompt=tokens, max_tokens=n, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = c.choices[0]
    return choice.model_extra["token_ids"], choice.logprobs.token_logprobs


def test_echo_scores_the_prompt_as_the_model_generates_it(server):
    client, model = server.client(), server.model()
    context = server.tokenize("The capital of France is")
    continuation, gen_logprobs = generate(client, model, context, 6)

    # lm-evaluation-harness's request: token prompts, echo, logprobs 1, max_tokens 1.
    other = server.tokenize("Water boils at a temperature of")
    c = client.completions.create(model=model, prompt=[context + continuation, other], echo=True, logprobs=1,
                                  max_tokens=1, temperature=0, seed=1234)
    assert len(c.choices) == 2
    first, second = sorted(c.choices, key=lambda ch: ch.index)
    lp = first.logprobs
    assert len(lp.token_logprobs) == len(context) + len(continuation) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert len(second.logprobs.token_logprobs) == len(other) + 1
    # Echoed: the prompt's text, then the generated token's.
    assert first.text.startswith("The capital of France is")
    assert "".join(lp.tokens) == first.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    # The continuation's scores are those the model gave its tokens as it generated them, and it is
    # greedy: each is the most likely token at its position (lm-eval's `is_greedy`).
    scored = lp.token_logprobs[len(context):-1]
    tops = lp.top_logprobs[len(context):-1]
    assert len(scored) == len(continuation)
    for got, want in zip(scored, gen_logprobs):
        assert abs(got - want) < 1e-4, (scored, gen_logprobs)
    assert all(abs(x - max(top.values())) < 1e-6 for x, top in zip(scored, tops))
    # Not greedy where the prompt says something else.
    surprise = server.tokenize(" Berlin")[0]
    c = client.completions.create(model=model, prompt=context + [surprise], echo=True, logprobs=1, max_tokens=0,
                                  temperature=0)
    tail = c.choices[0].logprobs
    assert tail.token_logprobs[-1] < max(tail.top_logprobs[-1].values())
    assert c.usage.completion_tokens == 0 and c.choices[0].finish_reason == "length"


def test_a_scored_prompt_is_computed_whole_and_scores_the_same_cached_or_not(server):
    client, model = server.client(), server.model()
    prompt = long_text(300, seed=41)
    kw = dict(model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=0, temperature=0)
    # Its KV cached first, by a plain request.
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    for c in (a, b):
        details = c.usage.prompt_tokens_details
        assert details.cached_tokens == 0
        assert details.model_extra["cache_miss"]["reason"] == "prompt_logprobs"
        assert c.choices[0].text == prompt
        assert len(c.choices[0].logprobs.token_logprobs) == plain.usage.prompt_tokens
    assert a.choices[0].logprobs.token_logprobs == b.choices[0].logprobs.token_logprobs
    assert a.choices[0].logprobs.top_logprobs == b.choices[0].logprobs.top_logprobs
    m = server.metrics()
    assert m['kura:prefix_cache_misses_total{reason="prompt_logprobs"}'] >= 2


def test_echo_streams_the_prompt_first(server):
    client, model = server.client(), server.model()
    kw = dict(model=model, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True, n=2)
    for logprobs in (None, 1):
        whole = client.completions.create(logprobs=logprobs, **kw)
        chunks = [ch for ch in client.completions.create(stream=True, logprobs=logprobs, **kw) if ch.choices]
        for i in range(2):
            mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == i]
            assert mine[0].text == "Once upon a time"
            text = "".join(ch.text for ch in mine)
            assert text == whole.choices[i].text
            if logprobs:
                streamed = [x for ch in mine if ch.logprobs for x in ch.logprobs.token_logprobs]
                assert streamed == whole.choices[i].logprobs.token_logprobs
                assert streamed[0] is None


def test_echo_without_logprobs_reads_the_cache(server):
    client, model = server.client(), server.model()
    prompt = long_text(200, seed=42)
    kw = dict(model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text.startswith(prompt) and len(a.choices[0].text) > len(prompt)
    assert b.usage.prompt_tokens_details.cached_tokens > 0


def test_echo_refusals_name_the_field(server):
    url = server.url + "/v1/completions"
    model = server.model()
    r = httpx.post(url, json={"model": model, "prompt": "Hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = httpx.post(url, json={"model": model, "prompt": "Hi", "echo": True, "cached_content": "cachedContents/x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    r = httpx.post(url, json={"model": model, "prompt": "Hi", "echo": True, "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    # The echoed prompts' scores count toward what a response not streamed may hold (2^20): 9 choices ×
    # 6,000 prompt tokens × (1 + 20) is past it, refused before anything runs.
    r = httpx.post(url, json={"model": model, "prompt": [7] * 6000, "echo": True, "logprobs": 20, "n": 9,
                              "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert "scored prompts" in r.json()["error"]["message"]
    # A prompt is scored whole before any of it is sent, so a stream holds its scores as well (once,
    # whatever its n): 9 prompts × 6,000 tokens × (1 + 20) is past the bound streamed too.
    r = httpx.post(url, json={"model": model, "prompt": [[7] * 6000] * 9, "echo": True, "logprobs": 20,
                              "max_tokens": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert "streamed or not" in r.json()["error"]["message"]


def test_prompt_logprobs_as_vllm_reports_them(server):
    client, model = server.client(), server.model()
    prompt = server.tokenize("The capital of France is Paris, and the capital of Italy is Rome.")
    c = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 3})
    choice = c.choices[0]
    scores = choice.model_extra["prompt_logprobs"]
    assert len(scores) == len(prompt) and scores[0] is None
    legacy = choice.logprobs
    for i, row in enumerate(scores[1:], start=1):
        token = row[str(prompt[i])]
        # The token's own entry: the echo's logprob, and its rank among the vocabulary.
        assert token["logprob"] == legacy.token_logprobs[i]
        assert isinstance(token["decoded_token"], str)
        # The three most likely, ranks 1..3 in order of logprob; the token once, with its place among
        # them where it is one of them, else with its rank in the vocabulary, past theirs.
        top = sorted((e for e in row.values() if e["rank"] <= 3), key=lambda e: e["rank"])
        assert [e["rank"] for e in top] == [1, 2, 3], row
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(top, top[1:]))
        if len(row) == 3:
            assert token["logprob"] == top[token["rank"] - 1]["logprob"], row
        else:
            assert len(row) == 4 and token["rank"] > 3 and token["logprob"] <= top[2]["logprob"], row
        # The echo asked one alternative: it reports the most likely alone.
        assert list(legacy.top_logprobs[i].values()) == [top[0]["logprob"]]
    # Without echo the text is the completion alone, and the scores the same.
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": 0})
    again = plain.choices[0].model_extra["prompt_logprobs"]
    assert choice.text.endswith(plain.choices[0].text)
    assert plain.choices[0].logprobs is None
    assert [r and {k: v["logprob"] for k, v in r.items()} for r in again] == \
        [r and {str(t): r[str(t)]["logprob"]} for r, t in zip(scores, prompt)]

    # Chat: the templated prompt's scores, once, at the top of the response.
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                         "temperature": 0, "n": 2, "prompt_logprobs": 1})
    body = r.json()
    assert r.status_code == 200, body
    templated = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"] == templated["count"]
    assert body["prompt_logprobs"][0] is None
    for row, token in zip(body["prompt_logprobs"][1:], templated["tokens"][1:]):
        assert str(token) in row and 1 <= len(row) <= 2, (token, row)
    assert body["usage"]["prompt_tokens_details"]["cache_miss"]["reason"] == "prompt_logprobs"

    # Several prompts × n: each choice carries its own prompt's scores.
    prompts = [server.tokenize("One two three four"), server.tokenize("Green leaves fall")]
    c = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    for ch in c.choices:
        mine = prompts[ch.index // 2]
        assert ch.model_extra["prompt_token_ids"] == mine
        rows = ch.model_extra["prompt_logprobs"]
        assert rows[0] is None and [list(r) for r in rows[1:]] == [[str(t)] for t in mine[1:]]

    url = server.url + "/v1/completions"
    for extra in ({"stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        body = {"model": model, "prompt": "Hi", "max_tokens": 1, "prompt_logprobs": 1, **extra}
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", (extra, r.text)
