"""What a hostile or careless user can do to a real `kura serve` process on the default model: bad flags
and key files at start-up, floods of silent connections, partial requests and unread streams at shutdown,
large prompts while /health is probed, batched prompts and logprobs through the official client."""

import json
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time

import httpx
import pytest

from conftest import EXACT, KuraServer, closed_by_peer, kura_bin, model_path


def start_fails(*args: str, timeout: float = 120) -> str:
    """Runs `kura serve` with `args`; it must exit non-zero by itself (not by a signal). Returns its output."""
    p = subprocess.run(
        [kura_bin(), "serve", "--model", model_path(), "--port", "0", *args],
        capture_output=True, text=True, timeout=timeout,
    )
    assert p.returncode > 0, f"rc {p.returncode}: {p.stdout}{p.stderr}"
    return p.stdout + p.stderr


def test_bad_startup_flags_are_refused_with_the_flag_named(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# no keys here\n\n   \n")
    out = start_fails("--api-key-file", str(empty))
    assert "holds no API key" in out and "without authentication" in out, out
    out = start_fails("--request-timeout-s", "9223372036854775807")
    assert "--request-timeout-s" in out, out
    out = start_fails("--shutdown-grace-s", "18446744073709551615")
    assert "--shutdown-grace-s" in out, out
    out = start_fails("--max-queue", "0")
    assert "--max-queue" in out, out
    out = start_fails("--served-model-name", "")
    assert "--served-model-name" in out, out
    out = start_fails("--max-body-size", "0")
    assert "--max-body-size" in out, out
    out = start_fails("--max-connections", "100000000")
    assert "--max-connections" in out, out


def test_port_zero_logs_the_bound_port():
    p = subprocess.Popen(
        [kura_bin(), "serve", "--model", model_path(), "--port", "0", "--kv-cache-memory", "32MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.time() + 120
        port = None
        while time.time() < deadline and port is None:
            line = p.stdout.readline()
            assert line, "kura serve exited before it listened"
            m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if m:
                port = int(m.group(1))
        assert port and port != 0
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(60)


def test_health_answers_through_a_flood_of_silent_connections():
    s = KuraServer("--kv-cache-memory", "32MiB", "--max-connections", "500")
    flood = []
    try:
        for _ in range(3000):
            c = socket.create_connection(("127.0.0.1", s.port))
            flood.append(c)
        for _ in range(5):
            assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        assert s.proc.poll() is None
        assert "connection limit reached" in s.log(), s.log()[-2000:]
        # The oldest silent connections were closed to make room: reading them gives end of file.
        closed = closed_by_peer(flood[:200], 0.5)
        assert closed >= 150, closed
    finally:
        for c in flood:
            c.close()
        s.stop()


def test_sigterm_exits_after_the_grace_despite_partial_requests_and_unread_streams():
    s = KuraServer("--kv-cache-memory", "64MiB", "--shutdown-grace-s", "2")
    held = []
    try:
        partial_head = socket.create_connection(("127.0.0.1", s.port))
        partial_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        short_body = socket.create_connection(("127.0.0.1", s.port))
        short_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 500\r\n\r\n{\"prompt\": ")
        unread = socket.create_connection(("127.0.0.1", s.port))
        unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 2000, "stream": True,
                           "logprobs": 20, "user": "x", "ignore_eos": True}).encode()
        unread.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        held += [partial_head, short_body, unread]
        # The unread stream is running (its tokens pile up behind a full socket): the grace has to end it.
        deadline = time.time() + 60
        while s.metrics()["kura:num_requests_running"] < 1:
            assert time.time() < deadline, s.log()[-3000:]
            time.sleep(0.05)  # poll interval
        t0 = time.time()
        s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(timeout=30)
        took = time.time() - t0
        print(f"\nexit {rc} {took:.1f} s after SIGTERM (grace 2 s)")
        assert rc == 0, s.log()[-3000:]
        assert "shutdown grace period over" in s.log(), s.log()[-3000:]
    finally:
        for c in held:
            c.close()
        s.stop()


def test_health_stays_fast_while_large_prompts_are_tokenized():
    s = KuraServer("--kv-cache-memory", "64MiB", "--max-body-size", "4MiB")
    try:
        big = ("The quick brown fox jumps over the lazy dog near the river bank. " * 3200)[:200_000]
        results = []
        stop = threading.Event()

        def send():
            # Back to back until the probes are done: a tokenization is in flight whenever one is taken,
            # however fast this machine tokenizes.
            while not stop.is_set():
                r = httpx.post(s.url + "/tokenize", json={"prompt": big}, timeout=300)
                results.append(r.status_code)

        threads = [threading.Thread(target=send) for _ in range(4)]
        for t in threads:
            t.start()
        health_ms = []
        try:
            while len(health_ms) < 10:
                assert all(t.is_alive() for t in threads), results
                t0 = time.perf_counter()
                assert httpx.get(s.url + "/health", timeout=10).status_code == 200
                health_ms.append((time.perf_counter() - t0) * 1000)
                time.sleep(0.02)  # paces the probes
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert len(results) >= 4 and results == [200] * len(results), results
        health_ms.sort()
        print(f"\n/health during {len(results)} x 200 KB tokenization: {len(health_ms)} probes, "
              f"median {health_ms[len(health_ms) // 2]:.1f} ms, max {health_ms[-1]:.1f} ms")
    finally:
        s.stop()


@pytest.fixture(scope="module")
def exact_server():
    s = KuraServer("--kv-cache-memory", "128MiB", *EXACT)
    yield s
    s.stop()


def test_a_list_of_prompts_through_the_openai_client(exact_server):
    s = exact_server
    client = s.client()
    model = s.model()
    prompts = ["The capital of France is", "One, two, three,"]
    r = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    completion_tokens = 0
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        assert r.choices[2 * p].text == alone.choices[0].text
        assert r.choices[2 * p + 1].text == alone.choices[0].text
        completion_tokens += 2 * alone.usage.completion_tokens
    assert r.usage.completion_tokens == completion_tokens
    assert r.usage.prompt_tokens == sum(len(s.tokenize(p)) for p in prompts)


def test_logprob_alternatives_are_never_collapsed_and_bytes_are_the_tokens_own(exact_server):
    s = exact_server
    client = s.client()
    model = s.model()
    # Non-Latin text makes the model produce tokens that are parts of a character (byte tokens), many of
    # which decode alone to the same replacement character.
    prompt = "日本語の文章です。東京は日本の首都です。京都は古い都です。"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, logprobs=20)
    tops = r.choices[0].logprobs.top_logprobs
    assert tops and all(len(t) == 20 for t in tops), [len(t) for t in tops]

    messages = [{"role": "user", "content": "Repeat exactly: " + prompt}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    partial = [i for i, t in enumerate(content) if "\ufffd" in t.token]
    assert partial, "the answer has no token that is part of a character: " + chat.choices[0].message.content
    # A token that is part of a character reports its own byte(s), not U+FFFD's three bytes.
    for i in partial:
        assert b"\xef\xbf\xbd" not in bytes(content[i].bytes), content[i]

    # The answer cut inside a character, wherever the model happens to stop: greedy decoding repeats the
    # same tokens, so `max_tokens` ending at the first token that starts a character but does not finish
    # it cuts there. The text then ends in one U+FFFD for the unfinished character (as Python's
    # `decode(errors="replace")`, llama.cpp and HF tokenizers do), while the tokens' bytes keep the raw
    # partial bytes: the bytes put together, decoded that way, are the text, streamed or not.
    def starts_a_character(b: bytes) -> bool:
        try:
            b.decode()
            return False
        except UnicodeDecodeError as e:
            return e.reason == "unexpected end of data"

    cut = next(i for i in partial if starts_a_character(bytes(content[i].bytes)))
    short = client.chat.completions.create(
        model=model, messages=messages, max_tokens=cut + 1, temperature=0, logprobs=True, top_logprobs=1,
    )
    assert short.choices[0].finish_reason == "length"
    tokens = short.choices[0].logprobs.content
    assert [t.token for t in tokens] == [t.token for t in content[: cut + 1]]
    joined = b"".join(bytes(t.bytes) for t in tokens)
    text = short.choices[0].message.content
    assert text.endswith("\ufffd") and not joined.endswith(b"\xef\xbf\xbd"), (text, joined)
    assert joined.decode("utf-8", errors="replace") == text, (joined, text)
    streamed = client.chat.completions.create(
        model=model, messages=messages, max_tokens=cut + 1, temperature=0, stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    # The whole answer obeys the same rule, less a final end-of-turn token's bytes, which are not text.
    whole = b"".join(bytes(t.bytes) for t in content if t.token != "<|im_end|>")
    assert whole.decode("utf-8", errors="replace") == chat.choices[0].message.content


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_memory_a_burst_of_large_grammars_freed_is_given_back():
    """Grammars of tens of thousands of rules, compiled on the server's threads, left 120–250 MB that
    malloc kept after they were freed; the server gives it back within seconds."""
    s = KuraServer("--kv-cache-memory", "64MiB")
    try:
        pid = s.proc.pid
        chat = {"messages": [{"role": "user", "content": "pick one"}], "max_tokens": 4}
        assert httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=120).status_code == 200
        base = rss_kib(pid)
        enum = [f"option-{i:06d}-" + "x" * (i % 13) for i in range(40000)]
        schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string", "enum": enum}}}
        for _ in range(3):
            r = httpx.post(s.url + "/v1/chat/completions", json={**chat, "response_format": schema}, timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"].startswith('"option-'), r.text
        lark = "start: " + " | ".join(f'"w{i}"' for i in range(60000))
        r = httpx.post(s.url + "/v1/chat/completions", json={**chat, "structured_outputs": {"grammar": lark}},
                       timeout=300)
        assert r.status_code == 400 and "grammar" in r.text, r.text
        # Given back, all but what is still in use (here 30-50 MiB; the trim runs only past 64 MiB of
        # growth): without it, 120-250 MiB stayed.
        limit = base + 96 * 1024
        # The burst held memory: the high-water mark rose past the limit by more than the noise, so that
        # a server keeping what it held fails the check below (it rose 126-250 MiB on these machines).
        peak = rss_kib(pid, "VmHWM")
        assert peak > limit + 16 * 1024, (base, peak)
        deadline = time.monotonic() + 30
        while (now := rss_kib(pid)) > limit and time.monotonic() < deadline:
            time.sleep(0.5)
        assert now <= limit, f"resident {now} KiB, {now - base} KiB over {base} KiB before the burst (peak {peak})"
        # Still serving.
        assert httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=120).status_code == 200
    finally:
        s.stop()
