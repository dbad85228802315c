"""Many clients at once: a shared system prompt computed once, overload against a small KV pool, and a
long prompt cut into steps beside a stream (`--prefill-step-ms`)."""

import asyncio
import threading
import time

import httpx
import openai

from conftest import BLOCK, EXACT, KuraServer, long_text


def test_sixteen_concurrent_requests_compute_a_shared_system_prompt_once():
    s = KuraServer("--kv-cache-memory", "256MiB", "--max-num-batched-tokens", "512", *EXACT)
    try:
        model = s.model()
        system = long_text(1010, seed=21)
        sys_tokens = len(s.tokenize(system))
        assert sys_tokens >= 1000, sys_tokens
        questions = [f"Question {i}: name one {w}." for i, w in enumerate(["colour", "city", "animal", "fruit"] * 4)]

        def ask(q, client):
            return client.completions.create(model=model, prompt=system + "\n" + q, max_tokens=8, temperature=0)

        before = s.metrics()

        async def all_at_once():
            client = s.async_client()
            return await asyncio.gather(*[
                client.completions.create(model=model, prompt=system + "\n" + q, max_tokens=8, temperature=0)
                for q in questions
            ])

        results = asyncio.run(all_at_once())
        after = s.wait_idle()
        computed = after["kura:prompt_tokens_computed_total"] - before["kura:prompt_tokens_computed_total"]
        total = sum(r.usage.prompt_tokens for r in results)
        shared_blocks = sys_tokens // BLOCK * BLOCK
        print(f"\n16 requests, {total} prompt tokens, system prompt {sys_tokens} tokens: computed {computed:.0f}")
        # The system prompt's whole blocks are computed by one request; the 15 others reuse them (cached
        # or while still pending), computing only their own suffix.
        assert computed <= total - 15 * shared_blocks, (computed, total, shared_blocks)
        assert after["kura:prefix_cache_hits_total"] - before["kura:prefix_cache_hits_total"] >= 15 * shared_blocks
        # Correct: each answer equals the same request sent alone afterwards.
        client = s.client()
        for q, r in zip(questions, results):
            assert r.choices[0].finish_reason in ("stop", "length")
            assert ask(q, client).choices[0].text == r.choices[0].text
    finally:
        s.stop()


def overload_server(*extra: str) -> KuraServer:
    # Each request: ~60 prompt tokens + 64 generated ≈ 8 blocks of 16; the pool holds 32 blocks (4 requests).
    return KuraServer("--kv-cache-memory", str(32 * BLOCK * 23040), "--kv-dtype", "f16", "--max-queue", "40", *extra)


def run_overload(s: KuraServer, disconnect_every: int = 0):
    model = s.model()
    prompt_of = lambda i: long_text(20, seed=100 + i)  # noqa: E731
    outcomes = {"done": 0, "429": 0, "disconnected": 0, "other": []}
    health_ms = []
    health_failures = []
    stop = threading.Event()

    def watch_health():
        # An assert in a thread would only warn; failures are collected and asserted by the caller.
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = httpx.get(s.url + "/health", timeout=10)
                if r.status_code != 200:
                    health_failures.append(f"status {r.status_code}: {r.text}")
            except httpx.HTTPError as e:
                health_failures.append(repr(e))
            health_ms.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.2)  # paces the health probes

    async def one(i, client):
        try:
            stream = await client.completions.create(
                model=model, prompt=prompt_of(i), max_tokens=64, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )
            chunks = 0
            async for chunk in stream:
                chunks += 1
                if disconnect_every and i % disconnect_every == 0 and chunks == 5:
                    await stream.close()
                    outcomes["disconnected"] += 1
                    return
                if chunk.choices and chunk.choices[0].finish_reason:
                    assert chunk.choices[0].finish_reason == "length"
            outcomes["done"] += 1
        except openai.RateLimitError as e:
            assert e.status_code == 429
            assert e.response.headers.get("retry-after")
            outcomes["429"] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            outcomes["other"].append(repr(e))

    async def all_clients():
        client = s.async_client(timeout=600)
        await asyncio.gather(*[one(i, client) for i in range(64)])

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    try:
        asyncio.run(all_clients())
    finally:
        stop.set()
        watcher.join()
    assert health_failures == [], health_failures
    assert health_ms, "/health was never probed"
    return outcomes, health_ms


def overload_and_settle(s: KuraServer, label: str) -> dict[str, float]:
    """64 clients against the 32-block pool: every one completes or gets 429, and once idle no block is
    referenced. Returns the metrics then."""
    assert "KV cache: 32 blocks of 16 tokens" in s.log(), s.log()
    outcomes, health_ms = run_overload(s)
    print(f"\n{label}: {outcomes}, /health max {max(health_ms):.0f} ms over {len(health_ms)} probes")
    assert outcomes["other"] == []
    assert outcomes["done"] + outcomes["429"] == 64
    assert outcomes["done"] >= 4
    m = s.wait_idle()
    assert m["kura:kv_cache_blocks_used"] == 0, "blocks still referenced after all requests ended"
    assert m["kura:kv_cache_usage_perc"] == 0
    assert m["kura:kv_cache_blocks_cached"] <= 32
    return m


def test_overload_completes_or_429s_preempts_and_leaks_nothing():
    s = overload_server()
    try:
        m = overload_and_settle(s, "overload")
        assert m["kura:num_preemptions_total"] > 0
    finally:
        s.stop()


def test_guaranteed_mode_overload_never_preempts():
    s = overload_server("--scheduling", "guaranteed")
    try:
        assert "scheduling: guaranteed" in s.log(), s.log()
        m = overload_and_settle(s, "guaranteed overload")
        # Every admitted request had its blocks reserved up to max_tokens: none was ever preempted.
        assert m["kura:num_preemptions_total"] == 0
        assert m["kura:kv_reserved_blocks"] == 0, "blocks still reserved after all requests ended"
    finally:
        s.stop()


def test_overload_with_clients_disconnecting_mid_stream():
    s = overload_server()
    try:
        outcomes, _ = run_overload(s, disconnect_every=3)
        print(f"\noverload with disconnects: {outcomes}")
        assert outcomes["other"] == []
        assert outcomes["done"] + outcomes["429"] + outcomes["disconnected"] == 64
        assert outcomes["disconnected"] > 0
        m = s.wait_idle()
        assert m["kura:request_cancelled_total"] >= 1
        assert m["kura:kv_cache_blocks_used"] == 0, "blocks still referenced after all requests ended"
    finally:
        s.stop()


def test_graceful_shutdown_finishes_in_flight_requests():
    s = KuraServer("--kv-cache-memory", "64MiB")
    try:
        client = s.client()
        stream = client.completions.create(
            model=s.model(), prompt="Tell me a story.", max_tokens=48, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(iter(stream))
        assert first.choices
        s.proc.send_signal(15)
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason == "length"
        assert s.proc.wait(60) == 0
    finally:
        s.stop()


def test_request_timeout_cancels_and_frees_blocks():
    s = KuraServer("--kv-cache-memory", "256MiB", "--request-timeout-s", "2")
    try:
        model = s.model()
        kw = dict(model=model, prompt="Tell me everything.", max_tokens=4000, temperature=0,
                  extra_body={"ignore_eos": True})
        try:
            s.client().completions.create(**kw)
            raise AssertionError("a 4000-token generation finished within 2 s")
        except openai.APIStatusError as e:
            assert e.status_code == 504
            body = e.body if isinstance(e.body, dict) else {}
            assert body.get("code", body.get("error", {}).get("code")) == "request_timeout", e.body
        try:
            for _ in s.client().completions.create(stream=True, **kw):
                pass
            raise AssertionError("the stream ended without a timeout error")
        except openai.APIError as e:
            assert "limit of 2 s" in str(e)
        m = s.wait_idle()
        assert m["kura:request_cancelled_total"] >= 2
        assert m["kura:kv_cache_blocks_used"] == 0
    finally:
        s.stop()


def test_a_client_that_half_closes_is_taken_as_gone():
    """A client that shuts down its sending side after a non-streamed request is taken as gone, as
    uvicorn takes it: the request is cancelled at once and its blocks freed (docs/serve.md)."""
    import json
    import socket
    from urllib.parse import urlparse

    s = KuraServer("--kv-cache-memory", "256MiB")
    try:
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}).encode()
        url = urlparse(s.url)
        sock = socket.create_connection((url.hostname, url.port))
        auth = "".join(f"{k}: {v}\r\n" for k, v in s.headers().items()).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
                     + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.time() + 30
        while s.metrics()["kura:num_requests_running"] < 1:
            assert time.time() < deadline, "the request never started"
            time.sleep(0.02)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(30)
        assert sock.recv(100) == b"", "a response was written after the half-close"
        m = s.wait_idle()
        assert m["kura:request_cancelled_total"] == 1
        assert m["kura:kv_cache_blocks_used"] == 0
        assert m.get("kura:generation_tokens_total", 0) < 4000
        sock.close()
    finally:
        s.stop()


def streams_beside_a_long_prompt(s: KuraServer) -> tuple[int, str, str, float]:
    """A streams 160 tokens; once it has 5, B sends a ~1,500-token prompt. Returns how many of A's tokens
    arrived between B's request and B's first token, A's and B's texts, and the prefill cap gauge."""
    model = s.model()
    client = s.client()
    arrivals: list[float] = []
    a_text: list[str] = []
    started = threading.Event()

    def stream_a():
        stream = client.completions.create(model=model, prompt="Count from one to a thousand:", max_tokens=160,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.monotonic())
                a_text.append(chunk.choices[0].text)
                if len(arrivals) == 5:
                    started.set()

    a = threading.Thread(target=stream_a)
    a.start()
    assert started.wait(60), "A streams"
    sent = time.monotonic()
    first = None
    b_text = []
    for chunk in client.completions.create(model=model, prompt=long_text(1400, seed=5), max_tokens=4,
                                           temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].text:
            first = first or time.monotonic()
            b_text.append(chunk.choices[0].text)
    a.join(120)
    assert first is not None and not a.is_alive()
    between = sum(1 for t in arrivals if sent < t < first)
    return between, "".join(a_text), "".join(b_text), s.metrics()["kura:prefill_cap_tokens"]


def test_a_long_prompt_beside_a_stream_is_cut_into_steps_and_the_stream_keeps_coming():
    # --prefill-step-ms 1: far below a decode step, so each step beside A's decode takes the floor of
    # 64 prompt tokens and B's ~1,500 tokens take about 23 steps, each with one of A's tokens.
    runs = {}
    for step in ("1", "0"):
        s = KuraServer("--prefill-step-ms", step, *EXACT)
        try:
            runs[step] = streams_beside_a_long_prompt(s)
        finally:
            s.stop()
    (between_cut, a_cut, b_cut, cap_cut), (between_whole, a_whole, b_whole, cap_whole) = runs["1"], runs["0"]
    # The gauge: the floor of 64 tokens with the cut, 0 without one.
    assert (cap_cut, cap_whole) == (64, 0), (cap_cut, cap_whole)
    print(f"\nA's tokens while B's prompt was computed: cut {between_cut}, whole {between_whole}")
    # Uncut, B's prompt is one step that A waits for; cut, A's tokens keep coming while it is computed
    # (both counts also hold the tokens A got while B's request was read and tokenized).
    assert between_cut >= 12, between_cut
    assert between_cut >= between_whole + 10, (between_cut, between_whole)
    # The same texts either way.
    assert (a_cut, b_cut) == (a_whole, b_whole)
