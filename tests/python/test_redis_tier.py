"""The shared KV tier in Redis (L4): a real `redis-server` (scripts/fetch-redis.sh), real replicas.

What is tested: a prefix computed on replica A is a hit on replica B (its `cached_tokens` and metric), with
the answer B would give computing it; a record damaged in Redis is refused and recomputed; one tenant's
records copied over another tenant's names, and records written by a replica with another fleet secret
copied over the fleet's names, are refused by their MAC (`kura:kv_remote_rejected_total`) and never
adopted; `rediss://` with a private CA and a password (the URL from a file) gives cross-replica hits and
never shows the password; Redis killed with SIGKILL in the middle of a run fails no request, and a replica
started while Redis is down serves.
"""

import concurrent.futures
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from conftest import KuraServer, free_port, kura_bin, long_text, model_path

ARGS = ("--threads", "1", "--kv-cache-memory", "64MiB")


def secret_file(directory: str, name: str = "fleet-secret") -> str:
    """A fresh fleet secret (64 hex characters) in a file of mode 0600."""
    path = os.path.join(directory, name)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> tuple[str, str]:
    """`--fleet-secret-file` arguments of the fleet the tests' replicas belong to."""
    return ("--fleet-secret-file", secret_file(str(tmp_path_factory.mktemp("fleet"))))


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

    def get(self, key: bytes) -> bytes | None:
        reply = self.command("GET", key)
        if reply.startswith(b"$-1"):
            return None
        head, _, rest = reply.partition(b"\r\n")
        assert head.startswith(b"$"), reply[:40]
        return rest[:int(head[1:])]

    def set(self, key: bytes, value: bytes):
        assert self.command("SET", key, value) == b"+OK\r\n"

    def keys(self) -> list[bytes]:
        reply = self.command("KEYS", "kura:kv:*").split(b"\r\n")
        return [line for line in reply if line.startswith(b"kura:kv:")]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def ask(server: KuraServer, system: str, question: str = "What is the first word?", max_tokens: int = 6,
        api_key: str | None = None):
    r = server.client(api_key).chat.completions.create(
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


def ask_and_store(server: KuraServer, redis, system: str, api_key: str | None = None):
    """Asks `server` about `system` and waits until its whole blocks are written to Redis: (answer, cached
    tokens, the Redis keys the request added)."""
    before_keys = set(redis.keys())
    before_stores = server.metrics()["kura:kv_remote_stores_total"]
    answer, cached, prompt = ask(server, system, api_key=api_key)
    blocks = (prompt - 1) // 16
    wait_for(server, "kura:kv_remote_stores_total", before_stores + blocks)
    new = sorted(set(redis.keys()) - before_keys)
    assert len(new) >= blocks
    return answer, cached, new


@pytest.fixture(scope="module")
def redis():
    r = Redis()
    yield r
    r.kill()


def test_a_prefix_computed_on_one_replica_is_a_hit_on_another(redis, fleet):
    a = KuraServer(*ARGS, "--kv-redis-url", redis.url, *fleet)
    b = KuraServer(*ARGS, "--kv-redis-url", redis.url, *fleet)
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


def test_a_damaged_record_is_refused_and_recomputed(redis, fleet):
    a = KuraServer(*ARGS, "--kv-redis-url", redis.url, *fleet)
    b = KuraServer(*ARGS, "--kv-redis-url", redis.url, *fleet)
    try:
        doc = "Damaged in Redis. " + long_text(120, seed=9)
        answer_a, _, new = ask_and_store(a, redis, doc)
        # Flip bytes inside every new record's payload (past any header).
        for key in new:
            assert redis.command("SETRANGE", key, "4000", "XXXX").startswith(b":")
        answer_b, cached_b, _ = ask(b, doc)
        mb = b.metrics()
        # Damage fails the MAC, checked before the record is decoded.
        assert mb["kura:kv_remote_rejected_total"] >= 1
        assert mb["kura:kv_remote_hit_blocks_total"] == 0
        assert cached_b == 0
        assert answer_b == answer_a
    finally:
        a.stop()
        b.stop()


def test_redis_killed_mid_run_fails_no_request(fleet):
    redis = Redis()
    a = KuraServer(*ARGS, "--kv-redis-url", redis.url, "--kv-redis-timeout-ms", "100", *fleet)
    b = KuraServer(*ARGS, "--kv-redis-url", redis.url, "--kv-redis-timeout-ms", "100", *fleet)
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
        c = KuraServer(*ARGS, "--kv-redis-url", redis.url, *fleet)
        try:
            text, _, _ = ask(c, docs[1])
            assert text
        finally:
            c.stop()
    finally:
        redis.kill()
        a.stop()
        b.stop()


def test_bad_redis_settings_are_refused_by_name(fleet, tmp_path):
    port = free_port()

    def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [kura_bin(), "serve", "--model", model_path(), "--port", str(port), *fleet, *args],
            capture_output=True, text=True, timeout=120, env=env,
        )

    proc = serve("--kv-redis-url", "http://:hunter2@nowhere")
    assert proc.returncode != 0
    assert "--kv-redis-url" in proc.stderr
    assert "hunter2" not in proc.stderr
    # A shared tier of prefixes needs prefix caching.
    proc = serve("--kv-redis-url", "redis://127.0.0.1:1", "--no-prefix-cache")
    assert proc.returncode != 0
    assert "prefix caching" in proc.stderr
    # The URL comes from one place only.
    url_file = tmp_path / "redis-url"
    url_file.write_text("redis://127.0.0.1:1\n")
    proc = serve("--kv-redis-url", "redis://127.0.0.1:1", "--kv-redis-url-file", str(url_file))
    assert proc.returncode != 0
    assert "--kv-redis-url and --kv-redis-url-file" in proc.stderr, proc.stderr
    proc = serve("--kv-redis-url-file", str(url_file), env={**os.environ, "KURA_KV_REDIS_URL": "redis://x:1"})
    assert proc.returncode != 0
    assert "--kv-redis-url-file" in proc.stderr and "$KURA_KV_REDIS_URL" in proc.stderr, proc.stderr
    # A CA file is for rediss:// only.
    proc = serve("--kv-redis-url", "redis://:hunter2@127.0.0.1:1", "--kv-redis-ca-file", str(url_file))
    assert proc.returncode != 0
    assert "--kv-redis-ca-file" in proc.stderr and "rediss://" in proc.stderr, proc.stderr
    assert "hunter2" not in proc.stderr
    # The Redis tier needs the fleet secret.
    proc = subprocess.run(
        [kura_bin(), "serve", "--model", model_path(), "--port", str(port), "--kv-redis-url", "redis://127.0.0.1:1"],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "KURA_FLEET_SECRET"},
    )
    assert proc.returncode != 0
    assert "fleet" in proc.stderr and "secret" in proc.stderr, proc.stderr


def copy_values(redis: Redis, sources: list[bytes], targets: list[bytes]):
    """Overwrites each target key with the value of a source key (in turn)."""
    values = [redis.get(k) for k in sources]
    assert all(values)
    for i, key in enumerate(targets):
        redis.set(key, values[i % len(values)])


def test_a_tenants_records_copied_over_another_tenants_names_are_rejected(redis, fleet):
    keys = ("--api-key", "tenant-a-key", "--api-key", "tenant-b-key")
    first = KuraServer(*ARGS, *keys, "--kv-redis-url", redis.url, *fleet, api_key="tenant-a-key")
    fresh = None
    try:
        doc_a = "Tenant A writes this. " + long_text(150, seed=31)
        doc_b = "Tenant B writes that. " + long_text(150, seed=32)
        _, _, keys_a = ask_and_store(first, redis, doc_a, api_key="tenant-a-key")
        honest_b, _, keys_b = ask_and_store(first, redis, doc_b, api_key="tenant-b-key")
        # Every record name of B's now holds one of A's records, whole and intact.
        copy_values(redis, keys_a, keys_b)
        fresh = KuraServer(*ARGS, *keys, "--kv-redis-url", redis.url, *fleet, api_key="tenant-b-key")
        answer, cached, _ = ask(fresh, doc_b, api_key="tenant-b-key")
        m = fresh.metrics()
        assert m["kura:kv_remote_rejected_total"] >= 1
        assert m["kura:kv_remote_hit_blocks_total"] == 0
        assert m["kura:kv_remote_connected"] == 1
        assert cached == 0
        assert answer == honest_b
    finally:
        first.stop()
        if fresh:
            fresh.stop()


def test_records_written_with_another_fleet_secret_are_rejected(redis, fleet, tmp_path):
    good = KuraServer(*ARGS, "--kv-redis-url", redis.url, *fleet)
    outsider = KuraServer(*ARGS, "--kv-redis-url", redis.url, "--fleet-secret-file",
                          secret_file(str(tmp_path), "another-secret"))
    fresh = None
    try:
        doc = "Forged by an outsider. " + long_text(150, seed=41)
        honest, _, good_keys = ask_and_store(good, redis, doc)
        # The outsider names the same prompt's blocks otherwise: no hit, records of its own.
        _, cached_out, outsider_keys = ask_and_store(outsider, redis, doc)
        assert cached_out == 0
        copy_values(redis, outsider_keys, good_keys)
        fresh = KuraServer(*ARGS, "--kv-redis-url", redis.url, *fleet)
        answer, cached, _ = ask(fresh, doc)
        m = fresh.metrics()
        assert m["kura:kv_remote_rejected_total"] >= 1
        assert m["kura:kv_remote_hit_blocks_total"] == 0
        assert cached == 0
        assert answer == honest
    finally:
        for s in (good, outsider, fresh):
            if s:
                s.stop()


def openssl(*args: str, cwd: str):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def tls_files(directory: str) -> tuple[str, str, str]:
    """A private CA and a server certificate for 127.0.0.1 signed by it: (ca.crt, server.crt, server.key)."""
    if not shutil.which("openssl"):
        pytest.fail("no openssl CLI: install Debian's openssl package")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=kura-test-ca",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=directory)
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=directory)
    with open(os.path.join(directory, "server.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.crt", "-days", "2", "-extfile", "server.ext", cwd=directory)
    return tuple(os.path.join(directory, n) for n in ("ca.crt", "server.crt", "server.key"))


def test_rediss_with_a_private_ca_and_a_password_from_a_file(fleet, tmp_path):
    ca, cert, key = tls_files(str(tmp_path))
    password = "pw-" + secrets.token_hex(16)
    port = free_port()
    redis = subprocess.Popen(
        [redis_server_bin(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", ca, "--tls-auth-clients", "no",
         "--requirepass", password, "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    servers = []
    try:
        deadline = time.time() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, "redis-server did not listen on its TLS port"
                time.sleep(0.05)  # poll interval
        url_file = tmp_path / "redis-url"
        url_file.write_text(f"rediss://default:{password}@127.0.0.1:{port}\n")
        url_file.chmod(0o600)
        tls = ("--kv-redis-url-file", str(url_file), "--kv-redis-ca-file", ca)
        a = KuraServer(*ARGS, *tls, *fleet)
        servers.append(a)
        b = KuraServer(*ARGS, *tls, *fleet)
        servers.append(b)
        doc = "Shared over TLS. " + long_text(200, seed=51)
        answer_a, cached_a, prompt = ask(a, doc)
        assert cached_a == 0
        blocks = (prompt - 1) // 16
        assert wait_for(a, "kura:kv_remote_stores_total", blocks) >= blocks
        answer_b, cached_b, _ = ask(b, doc)
        assert cached_b >= blocks * 16, f"{cached_b} of {prompt} cached on B"
        mb = b.metrics()
        assert mb["kura:kv_remote_hit_blocks_total"] >= blocks
        assert mb["kura:kv_remote_connected"] == 1
        assert answer_b == answer_a
        # Without the private CA, the server's certificate is not trusted: no connection, still serving.
        c = KuraServer(*ARGS, "--kv-redis-url-file", str(url_file), *fleet)
        servers.append(c)
        answer_c, cached_c, _ = ask(c, doc)
        mc = c.metrics()
        assert mc["kura:kv_remote_connected"] == 0
        assert mc["kura:kv_remote_errors_total"] >= 1
        assert mc["kura:kv_remote_hit_blocks_total"] == 0
        assert cached_c == 0 and answer_c == answer_a
        for s in servers:
            with open(f"/proc/{s.proc.pid}/cmdline", "rb") as f:
                assert password.encode() not in f.read()
            s.stop()
            log = s.log()
            assert "rediss://***@127.0.0.1" in log, log[-2000:]
            assert password not in log
    finally:
        for s in servers:
            s.stop()
        redis.kill()
        redis.wait()
