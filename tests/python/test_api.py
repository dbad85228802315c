"""The OpenAI API of `kura serve`, driven by the official `openai` client."""

import re

import anthropic
import httpx
import openai
import pytest

from conftest import KuraServer, long_text


def test_models_health_and_tokenize(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model()]
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + "/tokenize", json={"prompt": "The capital of France is"})
    body = r.json()
    assert r.status_code == 200
    assert body["count"] == len(body["tokens"]) > 0


def test_completion_non_streaming(server):
    c = server.client().completions.create(
        model=server.model(), prompt="The capital of France is", max_tokens=8, temperature=0
    )
    choice = c.choices[0]
    assert "Paris" in choice.text
    assert choice.finish_reason in ("stop", "length")
    assert c.usage.prompt_tokens > 0
    assert c.usage.completion_tokens <= 8
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert c.usage.prompt_tokens_details.cached_tokens is not None


def test_completion_streaming_matches_non_streaming(server):
    client = server.client()
    kw = dict(model=server.model(), prompt="Once upon a time", max_tokens=24, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens > 0
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])


def test_chat_non_streaming_and_streaming(server):
    client = server.client()
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    r = client.chat.completions.create(model=server.model(), messages=messages, max_tokens=20, temperature=0)
    answer = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert "Paris" in answer
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    stream = client.chat.completions.create(
        model=server.model(), messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_n_choices(server):
    r = server.client().completions.create(
        model=server.model(), prompt="My favourite colour is", max_tokens=10, temperature=1.0, n=3, seed=5
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason for c in r.choices)
    assert r.usage.completion_tokens >= 3
    chat = server.client().chat.completions.create(
        model=server.model(), messages=[{"role": "user", "content": "Say something."}], max_tokens=8, n=2,
        temperature=1.0, seed=9,
    )
    assert len(chat.choices) == 2


def test_stop_strings(server):
    client = server.client()
    kw = dict(model=server.model(), prompt="Count: 1, 2, 3, 4, 5, 6,", max_tokens=30, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    # Stop at the first comma that the model writes: the text ends right before it.
    assert "," in free, free
    r = client.completions.create(stop=[","], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[: free.index(",")]
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stop=",", stream=True, **kw) if c.choices
    )
    assert streamed == r.choices[0].text


def test_seed_reproducibility(server):
    client = server.client()
    kw = dict(model=server.model(), prompt=long_text(20, 3), max_tokens=20, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=4321, **kw).choices[0].text
    assert a == b
    assert a != c


def test_logprobs(server):
    r = server.client().chat.completions.create(
        model=server.model(), messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    c = server.client().completions.create(
        model=server.model(), prompt="Hello", max_tokens=3, temperature=0, logprobs=1
    )
    assert len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens


def test_logit_bias_bans_and_forces_tokens(server):
    """`logit_bias` through the official client: -100 on the greedy answer's first token makes another
    one first, +100 on one token makes it every token generated, in completions and chat, with the
    logprobs of the model's own distribution."""
    client = server.client()
    kw = dict(model=server.model(), prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    free = client.completions.create(**kw).choices[0]
    first = free.model_extra["token_ids"][0]
    banned = client.completions.create(logit_bias={str(first): -100}, **kw).choices[0]
    assert banned.model_extra["token_ids"][0] != first
    # The model's logprob of the token it chose, unbiased: the same as without a bias where both chose it.
    free_lp, banned_lp = free.logprobs.token_logprobs, banned.logprobs.token_logprobs
    assert banned_lp[0] < free_lp[0] <= 0
    forced_id = 1000
    forced = client.completions.create(logit_bias={str(forced_id): 100}, **kw).choices[0]
    assert forced.model_extra["token_ids"] == [forced_id] * 4
    # Drawn at temperature 1, and in chat.
    chat = client.chat.completions.create(
        model=server.model(), messages=[{"role": "user", "content": "Say hello."}], max_tokens=3,
        temperature=1.0, seed=3, logit_bias={str(forced_id): 100},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert chat.choices[0].model_extra["token_ids"] == [forced_id] * 3


def test_return_token_ids_gives_the_prompt_tokens_too(server):
    """vLLM's `return_token_ids`: a completion choice carries its prompt's tokens (`prompt_token_ids`) beside
    its generated ones, a chat response the templated prompt's, so that a client continues from exactly
    those tokens; a streamed response carries neither."""
    client, model = server.client(), server.model()
    text = "The capital of France is"
    c = client.completions.create(model=model, prompt=[text, "Hello"], n=2, max_tokens=3, temperature=0,
                                  extra_body={"return_token_ids": True})
    want = [server.tokenize(text)] * 2 + [server.tokenize("Hello")] * 2
    got = [ch.model_extra["prompt_token_ids"] for ch in sorted(c.choices, key=lambda ch: ch.index)]
    assert got == want
    assert all(len(ch.model_extra["token_ids"]) == 3 or ch.finish_reason == "stop" for ch in c.choices)
    tokens = [1, 504, 3575, 282, 4649]
    c = client.completions.create(model=model, prompt=tokens, max_tokens=1, extra_body={"return_token_ids": True})
    assert c.choices[0].model_extra["prompt_token_ids"] == tokens
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"return_token_ids": True})
    templated = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat.model_extra["prompt_token_ids"] == templated
    assert len(templated) == chat.usage.prompt_tokens
    streamed = [ch for ch in client.completions.create(model=model, prompt=text, max_tokens=2, stream=True,
                                                       extra_body={"return_token_ids": True})]
    assert all("prompt_token_ids" not in (ch.choices[0].model_extra if ch.choices else {}) for ch in streamed)


def test_a_field_the_server_does_not_read_is_refused_by_name(server):
    client = server.client()
    model = server.model()
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    # Another server's extension (vLLM's) and a misspelt name: a 400 that names them, not a silent drop.
    for extra in [{"guided_decoding_backend": "xgrammar"}, {"max_token": 5}]:
        (name,) = extra
        with pytest.raises(openai.BadRequestError, match=f"{name} is not a field of chat completions"):
            client.chat.completions.create(**chat, extra_body=extra)
        with pytest.raises(openai.BadRequestError, match=f"{name} is not a field of completions"):
            client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body=extra)
        with pytest.raises(openai.BadRequestError, match=f"{name} is not a field of responses"):
            client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False, extra_body=extra)
    a = anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="seed is not a field of messages"):
        a.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
                          extra_body={"seed": 1})
    # The fields it reads, its extensions among them, still pass.
    r = client.chat.completions.create(**chat, extra_body={"top_k": 5, "ignore_eos": True})
    assert r.usage.completion_tokens == 2
    # vLLM's chat_template_kwargs is read: a name this model's template does not read is left out, as
    # vLLM leaves it out, so that one client can send `enable_thinking` to every model.
    plain = client.chat.completions.create(**chat)
    r = client.chat.completions.create(**chat, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens


def test_min_tokens_holds_back_the_end_and_stop_strings(server):
    # vLLM's `min_tokens`: no end-of-sequence token and no stop string ends a choice before it has that
    # many tokens; greedy, the output is the same up to where the end was held back.
    c, model = server.client(), server.model()
    messages = [{"role": "user", "content": "Say hi."}]
    plain = c.chat.completions.create(model=model, messages=messages, max_tokens=80, temperature=0)
    assert plain.choices[0].finish_reason == "stop", plain
    n = plain.usage.completion_tokens + 8
    held = c.chat.completions.create(model=model, messages=messages, max_tokens=80, temperature=0,
                                     extra_body={"min_tokens": n})
    assert held.usage.completion_tokens >= n, held
    assert held.choices[0].message.content.startswith(plain.choices[0].message.content)
    assert len(held.choices[0].message.content) > len(plain.choices[0].message.content)
    # A stop string in the first `min_tokens` tokens does not end the choice; one after them does.
    prompt = "The capital of France is"
    cut = c.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0, stop=["."])
    assert cut.choices[0].text == " Paris", cut
    kept = c.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0, stop=["."],
                                extra_body={"min_tokens": 10})
    text = kept.choices[0].text
    assert text.startswith(" Paris.") and kept.usage.completion_tokens >= 10, kept
    streamed = c.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0, stop=["."],
                                    stream=True, extra_body={"min_tokens": 10})
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == text
    # On /v1/responses too, as vLLM's extension.
    r = c.responses.create(model=model, input="Say hi.", max_output_tokens=80, temperature=0, store=False,
                           extra_body={"min_tokens": n})
    assert r.usage.output_tokens >= n, r
    # More than the default max_tokens (16 on /v1/completions) is refused too, naming it.
    with pytest.raises(openai.BadRequestError, match=re.escape("(16, its default for this request)")):
        c.completions.create(model=model, prompt=prompt, extra_body={"min_tokens": 17})
    # More than max_tokens, or negative: refused by name.
    for bad, says in [(81, "min_tokens must be at most max_tokens (80), got 81"),
                      (-1, "min_tokens must be at least 0")]:
        with pytest.raises(openai.BadRequestError, match=re.escape(says)) as e:
            c.chat.completions.create(model=model, messages=messages, max_tokens=80,
                                      extra_body={"min_tokens": bad})
        assert e.value.body["param"] == "min_tokens"


def test_include_stop_str_in_output_and_allowed_token_ids(server):
    # vLLM's `include_stop_str_in_output`: the stop string that ended the choice ends its text.
    c, model = server.client(), server.model()
    kw = dict(model=model, prompt="Count: 1, 2, 3, 4, 5, 6,", max_tokens=30, temperature=0, stop=[","])
    cut = c.completions.create(**kw).choices[0]
    kept = c.completions.create(**kw, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.finish_reason == "stop" and kept.text == cut.text + ",", (cut.text, kept.text)
    streamed = c.completions.create(**kw, stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == kept.text
    # A stop token's text too: the comma as a stop token.
    (comma,) = server.tokenize(",")[-1:]
    del kw["stop"]
    by_token = c.completions.create(**kw, extra_body={"stop_token_ids": [comma]}).choices[0]
    with_token = c.completions.create(
        **kw, extra_body={"stop_token_ids": [comma], "include_stop_str_in_output": True}).choices[0]
    assert by_token.text == cut.text and with_token.text == cut.text + ",", (by_token.text, with_token.text)
    # vLLM's `allowed_token_ids`: only those tokens are written (end-of-sequence among the others).
    ids = server.tokenize(" yes no")[-2:]
    r = c.completions.create(model=model, prompt="Is Paris in France? Answer:", max_tokens=6,
                             temperature=1.0, seed=3, logprobs=1,
                             extra_body={"allowed_token_ids": ids, "return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and set(choice.model_extra["token_ids"]) <= set(ids), choice
    # Logprobs stay the model's own: its most likely token need not be allowed.
    assert len(choice.logprobs.tokens) == 6
    for bad, says in [([], "at least one token"), ([10**8], "outside the vocabulary")]:
        with pytest.raises(openai.BadRequestError, match=says) as e:
            c.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"allowed_token_ids": bad})
        assert e.value.body["param"] == "allowed_token_ids"


def test_bad_words_are_never_written(server):
    # vLLM's `bad_words`: a word's tokens, as a text starts and after a space, are never written in
    # full; the model goes on with its next best token.
    c, model = server.client(), server.model()

    def has(tokens, seq):
        return any(tokens[i:i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))

    def ids(r):
        return r.choices[0].model_extra["token_ids"]

    def variants(word):
        return [server.tokenize(word), server.tokenize(" " + word)]

    kw = dict(model=model, prompt="The capital of France is", max_tokens=20, temperature=0)
    plain = c.completions.create(**kw, extra_body={"return_token_ids": True})
    assert has(ids(plain), server.tokenize(" Paris")), plain
    no_paris = c.completions.create(**kw, extra_body={"return_token_ids": True, "bad_words": ["Paris"]})
    assert ids(no_paris) != ids(plain)
    assert not any(has(ids(no_paris), v) for v in variants("Paris")), no_paris
    # A word of several tokens: only its last is held back, and only right after the others.
    phrase = "the French"
    assert len(server.tokenize(" " + phrase)) == 2
    assert has(ids(no_paris), server.tokenize(" " + phrase)), no_paris.choices[0].text
    neither = c.completions.create(**kw, extra_body={"return_token_ids": True, "bad_words": ["Paris", phrase]})
    assert not any(has(ids(neither), v) for v in variants("Paris") + variants(phrase)), neither
    first = server.tokenize(" " + phrase)[0]
    assert first in ids(neither), "the phrase's first token is still written"
    streamed = c.completions.create(**kw, stream=True, extra_body={"bad_words": ["Paris", phrase]})
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == neither.choices[0].text
    # On chat and Responses too: the answer's first word is not written again.
    messages = [{"role": "user", "content": "Name a fruit."}]
    answer = c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"return_token_ids": True})
    word = answer.choices[0].message.content.split()[0].strip(".,!'\"")
    banned = c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"return_token_ids": True, "bad_words": [word]})
    assert not any(has(ids(banned), v) for v in variants(word)), (word, banned)
    assert ids(banned) != ids(answer)
    plain_r = c.responses.create(model=model, input="Name a fruit.", max_output_tokens=12, temperature=0,
                                 store=False)
    word = plain_r.output_text.split()[0].strip(".,!'\"")
    banned_r = c.responses.create(model=model, input="Name a fruit.", max_output_tokens=12, temperature=0,
                                  store=False, extra_body={"bad_words": [word]})
    assert banned_r.output_text != plain_r.output_text
    assert not re.search(r"(^|\s)" + re.escape(word) + r"\b", banned_r.output_text), (word, banned_r.output_text)
    # Refused by name: an empty or blank word, too many, too long, not a list of strings.
    for bad, says in [([""], "empty or blank"), (["  "], "empty or blank"),
                      (["w"] * 257, "at most 256 bad_words"), (["x" * 257], "at most 256 bytes"),
                      ("Paris", "bad_words"), ([1], "bad_words")]:
        with pytest.raises(openai.BadRequestError, match=says) as e:
            c.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"bad_words": bad})
        assert e.value.body["param"] == "bad_words" or "bad_words" in e.value.body["message"], e.value.body


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens():
    # vLLM's `truncate_prompt_tokens`: a prompt longer than the context is cut to its last tokens
    # instead of refused, and `-1` cuts it to fit beside `max_tokens`. (A context of 512 keeps the
    # prompts short.)
    server = KuraServer("--max-model-len", "512", "--kv-cache-memory", "64MiB")
    try:
        c, model = server.client(), server.model()
        text = long_text(700)
        tokens = server.tokenize(text)
        assert len(tokens) > 512
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            c.completions.create(model=model, prompt=text, max_tokens=2)
        r = c.completions.create(model=model, prompt=text, max_tokens=2, temperature=0,
                                 extra_body={"truncate_prompt_tokens": 100})
        assert r.usage.prompt_tokens == 100
        # The same as sending the last 100 tokens.
        same = c.completions.create(model=model, prompt=tokens[-100:], max_tokens=2, temperature=0)
        assert same.choices[0].text == r.choices[0].text
        r = c.completions.create(model=model, prompt=text, max_tokens=4, extra_body={"truncate_prompt_tokens": -1})
        assert r.usage.prompt_tokens == 512 - 4
        # Without max_tokens, room for the endpoint's default (16); chat asks for a max_tokens.
        r = c.completions.create(model=model, prompt=text, extra_body={"truncate_prompt_tokens": -1})
        assert r.usage.prompt_tokens == 512 - 16 and r.usage.completion_tokens <= 16
        with pytest.raises(openai.BadRequestError, match="needs max_completion_tokens"):
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                      extra_body={"truncate_prompt_tokens": -1})
        chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                         max_tokens=2, extra_body={"truncate_prompt_tokens": 50})
        assert chat.usage.prompt_tokens == 50
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens must be at least 1") as e:
            c.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"truncate_prompt_tokens": 0})
        assert e.value.body["param"] == "truncate_prompt_tokens"
    finally:
        server.stop()


def test_skip_special_tokens_false_keeps_their_text(server):
    # vLLM's `skip_special_tokens`: the special tokens a choice writes are left out of its text, unless
    # it is false. A bias makes the model write `<|im_start|>` (not a stop token).
    c, model = server.client(), server.model()
    (im_start,) = server.tokenize("<|im_start|>")[-1:]
    kw = dict(model=model, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(im_start): 100})
    skipped = c.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    assert skipped.model_extra["token_ids"] == [im_start] * 3 and skipped.text == ""
    kept = c.completions.create(**kw, logprobs=1, extra_body={"skip_special_tokens": False}).choices[0]
    assert kept.text == "<|im_start|>" * 3
    # The logprobs' texts are the text's, and their offsets add up.
    assert kept.logprobs.tokens == ["<|im_start|>"] * 3
    assert kept.logprobs.text_offset == [12 * i for i in range(3)]
    streamed = c.completions.create(**kw, stream=True, extra_body={"skip_special_tokens": False})
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == kept.text
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                     temperature=0, logit_bias={str(im_start): 100},
                                     extra_body={"skip_special_tokens": False})
    assert chat.choices[0].message.content == "<|im_start|>" * 2
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError, match="cannot be combined with tools") as e:
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                  tools=tools, extra_body={"skip_special_tokens": False})
    assert e.value.body["param"] == "skip_special_tokens"
