"""The shared KV tier in Redis (L4): a real `redis-server` (scripts/fetch-redis.sh), real replicas.

What is tested: a prefix computed on replica A is a hit on replica B (its `cached_tokens` and metric), with
the answer B would give computing it; a record damaged in Redis is refused and recomputed; Redis killed
with SIGKILL in the middle of a run fails no request, and a replica started while Redis is down serves.
"""

import concurrent.futures
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from conftest import KuraServer, free_port, kura_bin, long_text, model_path

ARGS = ("--threads", "1", "--kv-cache-memory", "64MiB")


def redis_server_bin() -> str:
    path = os.environ.get("KURA_REDIS_SERVER") or shutil.which("redis-server")
    if not path:
        pytest.fail("no redis-server: run scripts/fetch-redis.sh (scripts/test.sh does) or set KURA_REDIS_SERVER")
    return path


def resp_end(buf: bytes, at: int) -> int | None:
    """Where the RESP reply that starts at `at` ends, or None while it is incomplete."""
    line_end = buf.find(b"\r\n", at)
    if line_end < 0:
        return None
    kind, head = buf[at:at + 1], buf[at + 1:line_end]
    after = line_end + 2
    if kind in (b"+", b"-", b":"):
        return after
    if kind == b"$":
        n = int(head)
        return after if n < 0 else (after + n + 2 if len(buf) >= after + n + 2 else None)
    if kind == b"*":
        for _ in range(max(int(head), 0)):
            after = resp_end(buf, after)
            if after is None:
                return None
        return after
    raise ValueError(f"not a RESP reply: {buf[at:at + 40]!r}")


class Redis:
    """One `redis-server` on a free port, in memory only."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.dir = tempfile.mkdtemp(prefix="kura-redis-")
        self.proc = subprocess.Popen(
            [redis_server_bin(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                if self.command("PING") == b"+PONG\r\n":
                    return
            except OSError:
                time.sleep(0.05)  # poll interval: not listening yet
        raise RuntimeError("redis-server did not start")

    def command(self, *args: str | bytes) -> bytes:
        """One command in RESP; the raw reply (enough for PING, KEYS and SETRANGE)."""
        out = f"*{len(args)}\r\n".encode()
        for a in args:
            b = a if isinstance(a, bytes) else str(a).encode()
            out += f"${len(b)}\r\n".encode() + b + b"\r\n"
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(out)
            reply = b""
            # Read until the reply is whole (a reply may arrive in several segments).
            while (end := resp_end(reply, 0)) is None:
                chunk = s.recv(1 << 20)
                if not chunk:
                    raise ConnectionError(f"redis closed the connection after {reply!r}")
                reply += chunk
            return reply[:end]

    def keys(self) -> list[bytes]:
        reply = self.command("KEYS", "kura:kv:*").split(b"\r\n")
        return [line for line in reply if line.startswith(b"kura:kv:")]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def ask(server: KuraServer, system: str, question: str = "What is the first word?", max_tokens: int = 6):
    r = server.client().chat.completions.create(
        model=server.model(), max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
    )
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


def wait_for(server: KuraServer, name: str, at_least: float, timeout: float = 10) -> float:
    deadline = time.time() + timeout
    while True:
        v = server.metrics()[name]
        if v >= at_least or time.time() > deadline:
            return v
        time.sleep(0.05)  # poll interval


@pytest.fixture(scope="module")
def redis():
    r = Redis()
    yield r
    r.kill()


def test_a_prefix_computed_on_one_replica_is_a_hit_on_another(redis):
    a = KuraServer(*ARGS, "--kv-redis-url", redis.url)
    b = KuraServer(*ARGS, "--kv-redis-url", redis.url)
    plain = KuraServer(*ARGS)
    try:
        doc = "Shared through Redis. " + long_text(200, seed=5)
        answer_a, cached_a, prompt = ask(a, doc)
        assert cached_a == 0
        blocks = (prompt - 1) // 16
        assert wait_for(a, "kura:kv_remote_stores_total", blocks) >= blocks
        assert len(redis.keys()) >= blocks
        answer_b, cached_b, _ = ask(b, doc)
        assert cached_b >= blocks * 16, f"{cached_b} of {prompt} cached on B"
        mb = b.metrics()
        assert mb["kura:kv_remote_hit_blocks_total"] >= blocks
        assert mb["kura:kv_remote_connected"] == 1
        # B's answer from A's blocks is the answer of a replica computing everything itself.
        answer_plain, _, _ = ask(plain, doc)
        assert answer_b == answer_a == answer_plain
        # B wrote nothing back that A had written.
        assert b.metrics()["kura:kv_remote_stores_total"] < blocks
    finally:
        for s in (a, b, plain):
            s.stop()


def test_a_damaged_record_is_refused_and_recomputed(redis):
    a = KuraServer(*ARGS, "--kv-redis-url", redis.url)
    b = KuraServer(*ARGS, "--kv-redis-url", redis.url)
    try:
        doc = "Damaged in Redis. " + long_text(120, seed=9)
        before = set(redis.keys())
        answer_a, _, prompt = ask(a, doc)
        blocks = (prompt - 1) // 16
        wait_for(a, "kura:kv_remote_stores_total", blocks)
        new = sorted(set(redis.keys()) - before)
        assert len(new) >= blocks
        # Flip bytes inside every new record's payload (past any header).
        for key in new:
            assert redis.command("SETRANGE", key, "4000", "XXXX").startswith(b":")
        answer_b, cached_b, _ = ask(b, doc)
        mb = b.metrics()
        assert mb["kura:kv_remote_corrupt_total"] >= 1
        assert mb["kura:kv_remote_hit_blocks_total"] == 0
        assert cached_b == 0
        assert answer_b == answer_a
    finally:
        a.stop()
        b.stop()


def test_redis_killed_mid_run_fails_no_request():
    redis = Redis()
    a = KuraServer(*ARGS, "--kv-redis-url", redis.url, "--kv-redis-timeout-ms", "100")
    b = KuraServer(*ARGS, "--kv-redis-url", redis.url, "--kv-redis-timeout-ms", "100")
    try:
        docs = ["Redis dies. " + long_text(100, seed=s) for s in range(6)]

        def one(i: int):
            server = (a, b)[i % 2]
            return ask(server, docs[i % len(docs)], f"Question {i}?", max_tokens=8)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(one, i) for i in range(24)]
            # Kill Redis in the middle of the run, whatever the machine's speed: once a request has
            # ended and stored its blocks there, with most requests still to come.
            deadline = time.time() + 120
            while not (any(f.done() for f in futures) and redis.keys()):
                assert time.time() < deadline, "no request ended with its blocks in Redis"
                time.sleep(0.02)  # poll interval
            assert sum(f.done() for f in futures) < 24
            redis.kill()
            results = [f.result(timeout=120) for f in futures]
        assert len(results) == 24 and all(r[0] for r in results)
        # After the kill both still serve, and know Redis is gone.
        for server in (a, b):
            text, _, _ = ask(server, docs[0], "After?")
            assert text
            m = server.metrics()
            assert m["kura:kv_remote_connected"] == 0
            assert m["kura:kv_remote_errors_total"] >= 1
        # A replica started while Redis is down serves too.
        c = KuraServer(*ARGS, "--kv-redis-url", redis.url)
        try:
            text, _, _ = ask(c, docs[1])
            assert text
        finally:
            c.stop()
    finally:
        redis.kill()
        a.stop()
        b.stop()


def test_bad_redis_settings_are_refused_by_name():
    port = free_port()
    proc = subprocess.run(
        [kura_bin(), "serve", "--model", model_path(), "--port", str(port), "--kv-redis-url", "http://nowhere"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "--kv-redis-url" in proc.stderr
    # A shared tier of prefixes needs prefix caching.
    proc = subprocess.run(
        [kura_bin(), "serve", "--model", model_path(), "--port", str(port), "--kv-redis-url",
         "redis://127.0.0.1:1", "--no-prefix-cache"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "prefix caching" in proc.stderr
