"""A fleet: `kura serve --kv-events` replicas behind `kura router`, driven by the official clients.

What is tested: the router sends a shared prefix to the replica that holds it (KV events → index →
cost), tenants' keys keep their prefixes apart in the router's index as in the replicas, a replica killed
with SIGKILL in the middle of a run is drained and every request in flight there is sent again to the
survivor, an event gap makes the router resynchronize from a snapshot, one server named by two addresses
is routed as one, and the Anthropic API goes through.
KV events are the operator's (a tenant's key gets 403) and name blocks without their tokens. The router
holds against hostile clients as `kura serve` does: idle connections past its cap are evicted, a header
trickle is cut, a body that does not come gets 408, a request without a key gets 401 before its body is
read or tokenized, an oversized body gets 413 from the router itself, and a replica that refuses a request
is never drained for it. A stream whose replica dies ends with an error event in the API's shape.
"""

import concurrent.futures
import functools
import json
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time
import types

import anthropic
import httpx
import openai
import pytest

from conftest import (KuraServer, closed_by_peer, free_port, kura_bin, long_text, model_path, prometheus,
                      wait_healthy)

TENANT_KEYS = ("key-a", "key-b")
# `kura router`'s flags naming both tenants' keys.
TENANT_KEY_ARGS = tuple(a for k in TENANT_KEYS for a in ("--api-key", k))
NINE_MIB = 9 * 1024 * 1024


def private_file(path: pathlib.Path, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return str(path)


@functools.cache
def fleet_files() -> tuple[str, str]:
    """The fleet's secret and the replicas' operator key, in files only this user can read."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="kura-fleet-test-"))
    return (private_file(d / "fleet.secret", secrets.token_hex(32) + "\n"),
            private_file(d / "admin.key", "operator-" + secrets.token_hex(16) + "\n"))


def admin_key() -> str:
    return pathlib.Path(fleet_files()[1]).read_text().strip()


def replica_args(*extra: str) -> tuple[str, ...]:
    secret, admin = fleet_files()
    return ("--kv-events", "--threads", "1", "--kv-cache-memory", "64MiB",
            "--fleet-secret-file", secret, "--admin-api-key-file", admin, *extra)


def keyed_replica(*extra: str) -> KuraServer:
    return KuraServer(*replica_args(*TENANT_KEY_ARGS, *extra), api_key=TENANT_KEYS[0])


def clean_env() -> dict:
    """This environment without the fleet's secrets (they would stand in for the flags)."""
    return {k: v for k, v in os.environ.items() if k not in ("KURA_FLEET_SECRET", "KURA_ADMIN_API_KEY")}


class KuraRouter:
    """One `kura router` process on a free port over `replicas`, given the fleet's secret and the
    replicas' operator key unless `fleet_keys` is false."""

    def __init__(self, replicas: list[KuraServer], *args: str, fleet_keys: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = tempfile.NamedTemporaryFile(prefix="kura-router-", suffix=".log", delete=False)
        # --replica-header: the tests read which replica served each answer.
        cmd = [kura_bin(), "router", "--model", model_path(), "--port", str(self.port), "--replica-header"]
        for r in replicas:
            cmd += ["--replica", r.url]
        if fleet_keys:
            secret, admin = fleet_files()
            cmd += ["--fleet-secret-file", secret, "--replica-admin-key-file", admin]
        self.proc = subprocess.Popen([*cmd, *args], stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env=clean_env())
        if not wait_healthy(self.proc, self.url, "kura router", self.log, 60):
            self.stop()
            raise RuntimeError(f"kura router did not become healthy:\n{self.log()}")
        if fleet_keys:
            # The first snapshot of every replica, so that routing sees their caches from the first request.
            self.wait_metric(lambda m: all(m[f'kura_router:kv_snapshots_total{{replica="{r.url}"}}'] >= 1
                                           for r in replicas))

    def log(self) -> str:
        return pathlib.Path(self.log_file.name).read_text(errors="replace")

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        return prometheus(self.url)

    def wait_metric(self, ok, timeout: float = 10) -> dict[str, float]:
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if ok(m):
                return m
            if time.time() > deadline:
                raise AssertionError(f"router metrics never satisfied the condition: {m}\n{self.log()[-3000:]}")
            time.sleep(0.05)  # poll interval

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def label(replica: KuraServer) -> str:
    return f'{{replica="{replica.url}"}}'


def assert_every_replica_up(router: KuraRouter, replicas: list[KuraServer]):
    m = router.metrics()
    for r in replicas:
        assert m["kura_router:replica_up" + label(r)] == 1, (r.url, router.log()[-3000:])
        assert m["kura_router:replica_mark_downs_total" + label(r)] == 0, (r.url, router.log()[-3000:])


def chat(client: openai.OpenAI, model: str, system: str, question: str, max_tokens: int = 4):
    """One chat request; returns (replica index, cached tokens, prompt tokens)."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        max_tokens=max_tokens,
        temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
    )
    r = raw.parse()
    return int(raw.headers["x-kura-replica"]), r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


def read_response_head(sock: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    return head


@pytest.fixture(scope="module")
def fleet():
    replicas = [KuraServer(*replica_args()) for _ in range(2)]
    router = KuraRouter(replicas)
    yield replicas, router
    router.stop()
    for r in replicas:
        r.stop()


@pytest.fixture(scope="module")
def keyed_fleet():
    """Two replicas with tenant keys (each key its own tenant)."""
    replicas = [keyed_replica() for _ in range(2)]
    yield replicas
    for r in replicas:
        r.stop()


def test_kv_routing_keeps_each_prefix_on_the_replica_that_holds_it(fleet):
    replicas, router = fleet
    client = router.client()
    model = replicas[0].model()
    docs = [f"Document {d}. " + long_text(150, seed=d) for d in range(4)]
    first = {}
    for d, doc in enumerate(docs):
        first[d], cached, prompt = chat(client, model, doc, "Summarize it.")
        assert cached < prompt // 2, "a new document cannot be cached"
    # Each later question about a document goes where the document is, and finds it cached.
    for rnd in range(2):
        for d, doc in enumerate(docs):
            replica, cached, prompt = chat(client, model, doc, f"Question {rnd}: what is its first word?")
            assert replica == first[d], f"document {d} went to replica {replica}, its prefix is on {first[d]}"
            assert cached >= prompt - 32, f"document {d}: {cached} of {prompt} cached"
    m = router.metrics()
    predicted = sum(m[f'kura_router:predicted_cached_tokens_total{{replica="{r.url}"}}'] for r in replicas)
    reported = sum(m[f'kura_router:reported_cached_tokens_total{{replica="{r.url}"}}'] for r in replicas)
    # The index names whole blocks; the replicas also reuse a last partial block.
    assert 0 < predicted <= reported, (predicted, reported)
    assert reported - predicted <= 8 * 16, (predicted, reported)
    # The replicas' own counters agree with what the router saw come back.
    hits = sum(r.metrics()["kura:prefix_cache_hits_total"] for r in replicas)
    assert hits == reported


def test_a_scored_prompt_counts_no_cached_block_where_it_is_routed(fleet):
    """A prompt scored (`echo` with `logprobs`) is computed whole wherever it goes: the router counts no
    held block for it (its prediction of cached tokens does not move) and the replica reads none, while a
    plain request for the same prompt is predicted and found cached."""
    replicas, router = fleet
    client = router.client()
    model = replicas[0].model()
    doc = "Scored document. " + long_text(150, seed=77)

    def predicted():
        m = router.metrics()
        return sum(m["kura_router:predicted_cached_tokens_total" + label(r)] for r in replicas)

    client.completions.create(model=model, prompt=doc, max_tokens=1, temperature=0)
    before = predicted()
    scored = client.completions.create(model=model, prompt=doc, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0)
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    assert len(scored.choices[0].logprobs.token_logprobs) == scored.usage.prompt_tokens
    assert predicted() == before
    plain = client.completions.create(model=model, prompt=doc, max_tokens=1, temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0
    assert predicted() > before


def test_one_server_named_twice_is_routed_as_one():
    """`localhost` and `127.0.0.1` reach the same replica: both KV snapshots name the same server
    process, so the router marks the second address a duplicate (a metric, a warning naming both) and
    sends every request to the first, even in turn."""
    replica = KuraServer(*replica_args())
    twin = types.SimpleNamespace(url=replica.url.replace("127.0.0.1", "localhost"))
    assert twin.url != replica.url
    router = None
    try:
        router = KuraRouter([replica, twin], "--policy", "round-robin")
        m = router.wait_metric(lambda m: m["kura_router:replica_duplicate" + label(twin)] == 1)
        assert m["kura_router:replica_duplicate" + label(replica)] == 0
        assert m["kura_router:replica_up" + label(twin)] == 1
        # Two addresses, one server: /health counts it once, and the second address apart.
        health = httpx.get(router.url + "/health", timeout=10)
        assert health.status_code == 200
        assert health.json() == {"replicas": 2, "replicas_up": 1, "duplicates": 1}, health.text
        client = router.client()
        served = [chat(client, replica.model(), f"System prompt {i}.", "Hello?")[0] for i in range(4)]
        assert served == [0, 0, 0, 0], served
        m = router.metrics()
        assert m["kura_router:requests_total" + label(twin)] == 0
        assert m["kura_router:requests_total" + label(replica)] == 4
        log = router.log()
        assert "list each server once" in log and twin.url in log and replica.url in log, log[-3000:]
    finally:
        if router:
            router.stop()
        replica.stop()


class Relay:
    """A TCP relay from a port of its own to `port` on 127.0.0.1, in threads, until stopped: a second
    address of one server that can go away while the server stays."""

    def __init__(self, port: int):
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self):
        """Closes the port (new connections are refused) and every connection through it."""
        self.listener.close()
        with self.lock:
            for c in self.conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()


def test_a_duplicate_address_takes_over_when_the_first_goes_down():
    """One server behind two addresses, the first a relay: requests go to the first while it is up and
    the second is a duplicate; when the relay goes away the router marks the first down and the second
    takes the requests, counted in /health as the one replica up."""
    replica = KuraServer(*replica_args())
    relay = Relay(int(replica.url.rsplit(":", 1)[1]))
    router = None
    try:
        router = KuraRouter([relay, replica], "--policy", "round-robin")
        router.wait_metric(lambda m: m["kura_router:replica_duplicate" + label(replica)] == 1)
        client = router.client()
        model = replica.model()
        served = [chat(client, model, f"System prompt {i}.", "Hello?")[0] for i in range(3)]
        assert served == [0, 0, 0], served
        assert httpx.get(router.url + "/health", timeout=10).json() == {
            "replicas": 2, "replicas_up": 1, "duplicates": 1}
        relay.stop()
        m = router.wait_metric(lambda m: m["kura_router:replica_up" + label(relay)] == 0
                               and m["kura_router:replica_duplicate" + label(replica)] == 0)
        assert m["kura_router:replica_up" + label(replica)] == 1, router.log()[-3000:]
        served = [chat(client, model, f"Other prompt {i}.", "Hello?")[0] for i in range(3)]
        assert served == [1, 1, 1], served
        health = httpx.get(router.url + "/health", timeout=10)
        assert health.status_code == 200
        assert health.json() == {"replicas": 2, "replicas_up": 1, "duplicates": 0}, health.text
        assert "requests go to this replica again" in router.log(), router.log()[-3000:]
    finally:
        if router:
            router.stop()
        relay.stop()
        replica.stop()


def test_round_robin_scatters_what_kv_routing_keeps_together(fleet):
    replicas, _ = fleet
    rr = KuraRouter(replicas, "--policy", "round-robin")
    try:
        client = rr.client()
        model = replicas[0].model()
        doc = "Round robin. " + long_text(150, seed=42)
        seen = {chat(client, model, doc, f"Question {i}?")[0] for i in range(4)}
        assert seen == {0, 1}
    finally:
        rr.stop()


def test_tenants_prefixes_stay_apart_in_the_index(keyed_fleet):
    replicas = keyed_fleet
    router = KuraRouter(replicas, *TENANT_KEY_ARGS)
    fresh = None
    try:
        model = replicas[0].model()
        doc = "Shared text. " + long_text(150, seed=7)
        a = router.client(TENANT_KEYS[0])
        b = router.client(TENANT_KEYS[1])
        ra, _, prompt = chat(a, model, doc, "First?")
        ra2, cached_a, prompt = chat(a, model, doc, "Second?")
        assert ra2 == ra and cached_a >= prompt - 32
        # A router that never routed this prefix finds it from the replica's events alone: it names
        # tenant a's blocks as the replicas do (the tenant's name is keyed with the fleet's secret).
        fresh = KuraRouter(replicas, *TENANT_KEY_ARGS)
        key = "kura_router:predicted_cached_tokens_total" + label(replicas[ra])
        ra3, cached_a, prompt = chat(fresh.client(TENANT_KEYS[0]), model, doc, "Third?")
        assert ra3 == ra and cached_a >= prompt - 32
        assert fresh.metrics()[key] >= prompt - 32
        # Tenant b's blocks are salted apart: the router predicts no hit for b on a's replica...
        before = router.metrics()
        rb, cached_b, _ = chat(b, model, doc, "Second?")
        assert cached_b == 0
        after = router.metrics()
        key = "kura_router:predicted_cached_tokens_total" + label(replicas[rb])
        assert after[key] == before[key]
        # ...and a wrong key is refused by the router itself.
        with pytest.raises(openai.AuthenticationError):
            chat(router.client("wrong"), model, doc, "?")
        assert router.metrics()["kura_router:unauthorized_total"] == 1
    finally:
        router.stop()
        if fresh:
            fresh.stop()


def test_a_prompt_cache_key_keeps_requests_together_within_its_tenant_only(keyed_fleet):
    """A `prompt_cache_key` keeps a tenant's requests on the replica its first went to; another tenant
    giving the same key is routed as if it had never been given (it was one map for all tenants: the
    replica a key pointed to told another tenant that someone had used that key, and where)."""
    replicas = keyed_fleet
    router = KuraRouter(replicas, *TENANT_KEY_ARGS)
    try:
        model = replicas[0].model()
        loads = [f"kura_router:replica_reported_load{label(r)}" for r in replicas]

        def send(key: str, cache_key: str | None = None) -> int:
            # Every replica seen idle first: ties between them then go by turn, in order.
            router.wait_metric(lambda m: all(m[k] == 0 for k in loads))
            body = {"model": model, "prompt": "Hi", "max_tokens": 1}  # under one block: held by none
            if cache_key:
                body["prompt_cache_key"] = cache_key
            r = httpx.post(router.url + "/v1/completions", json=body, timeout=60,
                           headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return int(r.headers["x-kura-replica"])

        a, b = TENANT_KEYS
        home = send(a, "user-123")
        for _ in range(3):
            send(b)  # moves the turn
            assert send(a, "user-123") == home
        # The turn points away from tenant a's replica: b's first request with the same key goes by it.
        for _ in range(4):
            if send(b) == home:
                break
        else:
            raise AssertionError("the turn never came to tenant a's replica")
        away = send(b, "user-123")
        assert away != home, "tenant b was routed by tenant a's prompt_cache_key"
        # ...and then keeps to its own replica, while a keeps to its own.
        assert send(b, "user-123") == away
        assert send(a, "user-123") == home
    finally:
        router.stop()


def test_a_stored_response_stays_its_tenants_through_the_router(keyed_fleet):
    """Where a stored response lives is the router's to know, whose it is the replicas' to check: another
    tenant's key reads, continues and deletes nothing of it through the router, before and after the
    router learnt where it lives (a fresh router asks the replicas with the asking tenant's key)."""
    replicas = keyed_fleet
    router = KuraRouter(replicas, *TENANT_KEY_ARGS)
    fresh = None
    try:
        model = replicas[0].model()
        ask = dict(model=model, max_output_tokens=4, temperature=0)
        a, b = (router.client(k) for k in TENANT_KEYS)
        raw = a.responses.with_raw_response.create(input="Tenant a's question.", **ask)
        home, made = int(raw.headers["x-kura-replica"]), raw.parse()

        def b_is_refused(client):
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(made.id)
            with pytest.raises(openai.BadRequestError) as e:
                client.responses.create(input="Go on.", previous_response_id=made.id, **ask)
            assert "previous_response_id" in str(e.value.body), e.value.body
            with pytest.raises(openai.NotFoundError):
                client.responses.delete(made.id)

        b_is_refused(b)
        fresh = KuraRouter(replicas, *TENANT_KEY_ARGS)
        b_is_refused(fresh.client(TENANT_KEYS[1]))
        assert fresh.metrics()["kura_router:stored_responses_known"] == 0, "b's probes found nothing"
        for client in (a, fresh.client(TENANT_KEYS[0])):
            raw = client.responses.with_raw_response.retrieve(made.id)
            assert int(raw.headers["x-kura-replica"]) == home and raw.parse().id == made.id
        b_is_refused(fresh.client(TENANT_KEYS[1]))
        raw = a.responses.with_raw_response.create(input="And then?", previous_response_id=made.id, **ask)
        assert int(raw.headers["x-kura-replica"]) == home
    finally:
        router.stop()
        if fresh:
            fresh.stop()


def test_a_killed_replica_is_drained_and_every_request_ends():
    replicas = [KuraServer(*replica_args()) for _ in range(2)]
    router = KuraRouter(replicas, "--policy", "least-load")
    try:
        model = replicas[0].model()
        client = router.client()
        victim = replicas[1]
        max_tokens = 64

        def one(i: int):
            raw = client.chat.completions.with_raw_response.create(
                model=model, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": f"Count from {i} to {i + 40}."}],
            )
            return int(raw.headers["x-kura-replica"]), raw.parse().usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(24)]
            # The victim is frozen (SIGSTOP) once it has answered a request and is running others; frozen,
            # nothing it holds can finish, so the router's count of requests in flight there is exactly
            # what the kill cuts. Frozen with none in flight, it is thawed and tried again.
            deadline = time.time() + 120
            while True:
                assert time.time() < deadline, f"the victim never served and ran requests at once:\n{victim.log()[-2000:]}"
                assert not any(f.done() and f.exception() for f in futures), [f.exception() for f in futures if f.done()]
                served = router.metrics()["kura_router:requests_total" + label(victim)]
                if served >= 1 and victim.metrics()["kura:num_requests_running"] >= 1:
                    victim.proc.send_signal(signal.SIGSTOP)
                    router.metrics()  # a round trip, so that anything the victim sent before is read
                    m = router.metrics()
                    cut = m["kura_router:in_flight" + label(victim)]
                    served = m["kura_router:requests_total" + label(victim)]
                    if cut >= 1:
                        break
                    victim.proc.send_signal(signal.SIGCONT)
                time.sleep(0.01)  # poll interval
            victim.proc.send_signal(signal.SIGKILL)
            router.wait_metric(lambda m: m["kura_router:replica_up" + label(victim)] == 0, timeout=60)
            # A hang would be a failure: the timeout only turns it into one.
            results = [f.result(timeout=300) for f in futures]
        # Every request ends with its full answer: each one in flight on the killed replica had received
        # nothing yet (a non-streamed answer comes whole), so the router sent it again to the survivor.
        assert [n for _, n in results] == [max_tokens] * 24
        m = router.metrics()
        assert m["kura_router:retries_total"] >= cut, (m["kura_router:retries_total"], cut)
        # Nothing was answered by the victim after it was frozen: the retried requests were the survivor's.
        assert m["kura_router:requests_total" + label(victim)] == served
        assert sum(1 for r, _ in results if r == 0) == 24 - served
        # After the drain, every request goes to the survivor and succeeds.
        for i in range(4):
            replica, _, _ = chat(client, model, "After the kill.", f"Question {i}?")
            assert replica == 0
        assert router.metrics()["kura_router:requests_total" + label(victim)] == served
    finally:
        router.stop()
        for r in replicas:
            r.stop(signal.SIGKILL)


def test_an_event_gap_makes_the_router_resynchronize():
    # A ring of 2 events: one long prompt announces more blocks than that in one step.
    replica = KuraServer(*replica_args("--kv-events-buffer", "2"))
    router = KuraRouter([replica])
    try:
        model = replica.model()
        client = router.client()
        doc = "Gap. " + long_text(200, seed=3)
        chat(client, model, doc, "First?")
        lbl = label(replica)
        m = router.wait_metric(lambda m: m["kura_router:kv_event_gaps_total" + lbl] >= 1
                               and m["kura_router:kv_snapshots_total" + lbl] >= 2
                               and m["kura_router:indexed_blocks" + lbl] >= 10)
        # The index rebuilt from the new snapshot predicts the next request's hit.
        before = m["kura_router:predicted_cached_tokens_total" + lbl]
        _, cached, prompt = chat(client, model, doc, "Second?")
        after = router.metrics()["kura_router:predicted_cached_tokens_total" + lbl]
        assert after - before >= 10 * 16
        assert cached >= after - before
        assert "resynchroniz" in router.log()
    finally:
        router.stop()
        replica.stop()


def test_the_anthropic_api_goes_through_the_router(fleet):
    replicas, router = fleet
    client = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    system = "Anthropic through the router. " + long_text(120, seed=11)
    used = []
    for q in ("One?", "Two?"):
        raw = client.messages.with_raw_response.create(
            model=replicas[0].model(), max_tokens=4, system=system, messages=[{"role": "user", "content": q}]
        )
        used.append((int(raw.headers["x-kura-replica"]), raw.parse().usage.cache_read_input_tokens or 0))
    assert used[1][0] == used[0][0]
    assert used[1][1] > 100


def test_anthropic_token_counts_go_through_the_router_untokenized(fleet):
    """`messages.count_tokens` through the router: a replica's count, the replica named, nothing placed by
    the prompt (the router neither tokenizes it nor notes its blocks on a replica), and a replica's refusal
    passed on in Anthropic's shape."""
    replicas, router = fleet
    model = replicas[0].model()
    client = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    direct = anthropic.Anthropic(base_url=replicas[0].url, api_key="unused", max_retries=0)
    system = "Counted through the router. " + long_text(120, seed=12)
    msgs = [{"role": "user", "content": "How many?"}]
    before = router.metrics()
    raw = client.messages.with_raw_response.count_tokens(model=model, system=system, messages=msgs)
    assert int(raw.headers["x-kura-replica"]) in range(len(replicas))
    counted = raw.parse().input_tokens
    assert counted > 100
    assert counted == direct.messages.count_tokens(model=model, system=system, messages=msgs).input_tokens
    after = router.metrics()
    assert after["kura_router:tokenized_requests_total"] == before["kura_router:tokenized_requests_total"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=model, messages=msgs, extra_body={"max_tokens": 5})
    assert e.value.body["type"] == "error" and "max_tokens" in e.value.body["error"]["message"], e.value.body


def test_responses_continue_on_the_replica_that_stored_them(fleet):
    """The Responses API through a round-robin router, which would send each request to the other replica:
    every turn that names a previous response (streamed or not, and `input_tokens`) goes to the replica that
    stored it, which it learns from the answers it relays; a stored response is read and deleted through
    the router; a second router, which has relayed none of them, finds where one lives by asking the
    replicas."""
    replicas, _ = fleet
    model = replicas[0].model()
    rr = KuraRouter(replicas, "--policy", "round-robin")
    later = None
    try:
        client = rr.client()
        ask = dict(model=model, max_output_tokens=6, temperature=0)
        raw = client.responses.with_raw_response.create(input="Name a colour.", **ask)
        home, prev = int(raw.headers["x-kura-replica"]), raw.parse()
        tokenized = rr.metrics()["kura_router:tokenized_requests_total"]
        assert tokenized == 1, "a new conversation is placed by its blocks"
        for i in range(3):
            raw = client.responses.with_raw_response.create(input=f"And another ({i})?",
                                                            previous_response_id=prev.id, **ask)
            assert int(raw.headers["x-kura-replica"]) == home, f"turn {i}"
            prev = raw.parse()
            assert prev.status in ("completed", "incomplete") and prev.previous_response_id is not None
        assert rr.metrics()["kura_router:tokenized_requests_total"] == tokenized, (
            "a continuation's prompt is its server's to know: not tokenized by the router")
        # Streamed: the id read from the stream's events places the next turn too.
        raw = client.responses.with_raw_response.create(input="One more?", previous_response_id=prev.id,
                                                        stream=True, **ask)
        assert int(raw.headers["x-kura-replica"]) == home
        done = [e for e in raw.parse() if e.type in ("response.completed", "response.incomplete")]
        assert len(done) == 1
        streamed = done[0].response
        raw = client.responses.with_raw_response.create(input="Last one?", previous_response_id=streamed.id,
                                                        **ask)
        assert int(raw.headers["x-kura-replica"]) == home
        prev = raw.parse()
        # A continuation's length, as the replica holding it counts it (with the key that made it: the
        # router's table is kept per key).
        body = {"model": model, "input": "How long?", "previous_response_id": prev.id}
        routed = httpx.post(rr.url + "/v1/responses/input_tokens", json=body, timeout=30,
                            headers={"Authorization": "Bearer unused"})
        direct = httpx.post(replicas[home].url + "/v1/responses/input_tokens", json=body, timeout=30)
        assert routed.status_code == 200 and direct.status_code == 200, (routed.text, direct.text)
        assert int(routed.headers["x-kura-replica"]) == home
        assert routed.json()["input_tokens"] == direct.json()["input_tokens"] > 20
        m = rr.metrics()
        assert m["kura_router:responses_routed_total"] == 6
        assert m["kura_router:response_probes_total"] == 0, "every id was learnt from an answer"
        raw = client.responses.with_raw_response.retrieve(prev.id)
        assert int(raw.headers["x-kura-replica"]) == home and raw.parse().id == prev.id
        # A router that has relayed none of them asks the replicas.
        later = KuraRouter(replicas, "--policy", "round-robin")
        raw = later.client().responses.with_raw_response.retrieve(streamed.id)
        assert int(raw.headers["x-kura-replica"]) == home and raw.parse().id == streamed.id
        assert 1 <= later.metrics()["kura_router:response_probes_total"] <= 2
        for i in range(2):
            raw = later.client().responses.with_raw_response.create(
                input=f"From the new router ({i})?", previous_response_id=prev.id, **ask)
            assert int(raw.headers["x-kura-replica"]) == home
        # Deleted through the router: gone, there and through the router.
        client.responses.delete(prev.id)
        for c in (client, later.client()):
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(prev.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve("resp_" + "0" * 24)
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(input="Go on.", previous_response_id=prev.id, **ask)
        assert "previous_response_id" in str(e.value.body), e.value.body
    finally:
        rr.stop()
        if later is not None:
            later.stop()


def test_routes_the_router_does_not_route_get_json_errors_naming_those_it_does(fleet):
    _, router = fleet
    for method, path, status, code in [
        ("POST", "/v1/caches", 404, "unknown_url"),
        ("POST", "/tokenize", 404, "unknown_url"),
        ("GET", "/v1/caches", 404, "unknown_url"),
        ("GET", "/a/../b%ff", 404, "unknown_url"),
        ("PUT", "/v1/chat/completions", 405, "method_not_allowed"),
    ]:
        r = httpx.request(method, router.url + path, json={}, timeout=30)
        assert r.status_code == status, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == code, (path, r.text)
        if status == 404:
            assert "which routes /v1/chat/completions" in err["message"], r.text


def test_a_response_id_that_does_not_decode_gets_a_json_400(fleet):
    _, router = fleet
    for method in ("GET", "DELETE"):
        r = httpx.request(method, router.url + "/v1/responses/resp_%ff", timeout=30)
        assert r.status_code == 400, (method, r.status_code, r.text)
        assert r.json()["error"]["message"].startswith("the id in the path: "), (method, r.text)


def serve_fails(*args: str) -> str:
    p = subprocess.run([kura_bin(), "serve", "--model", model_path(), "--port", "0", *args],
                       capture_output=True, text=True, timeout=120, env=clean_env())
    assert p.returncode > 0, f"rc {p.returncode}: {p.stdout}{p.stderr}"
    return p.stdout + p.stderr


def sse_events(lines):
    """(event, data) of an SSE stream's lines."""
    event, data = None, []
    for line in lines:
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def assert_names_only(blocks_or_events: list[dict], allowed: set[str]):
    for b in blocks_or_events:
        assert set(b) <= allowed, b
        if "name" in b:
            assert len(b["name"]) == 32 and int(b["name"], 16) >= 0, b


def test_kv_events_are_the_operators_and_name_blocks_without_tokens():
    secret, admin = fleet_files()
    # --kv-events needs an operator key and the fleet's secret, and says so.
    out = serve_fails("--kv-events", "--fleet-secret-file", secret)
    assert "--kv-events" in out and "operator key" in out, out
    out = serve_fails("--kv-events", "--admin-api-key-file", admin)
    assert "--kv-events" in out and "--fleet-secret-file" in out, out
    replica = keyed_replica()
    try:
        operator = {"Authorization": f"Bearer {admin_key()}"}
        tenant = replica.headers()
        for path in ("/v1/kv/snapshot", "/v1/kv/events"):
            assert httpx.get(replica.url + path).status_code == 401, path
            r = httpx.get(replica.url + path, headers=tenant)
            assert r.status_code == 403, (path, r.text)
        snap = httpx.get(replica.url + "/v1/kv/snapshot", headers=operator).json()
        assert snap["tenants"] is True and snap["block_size"] == 16 and snap["blocks"] == []
        prompt = long_text(100)
        tokens = replica.tokenize(prompt)
        stored = []
        # A stream that stalls raises ReadTimeout (its keep-alive comes every 15 s) rather than hang.
        with httpx.stream("GET", replica.url + "/v1/kv/events", headers=operator, timeout=10) as stream:
            assert stream.status_code == 200
            events = sse_events(stream.iter_lines())
            kind, data = next(events)
            assert kind == "snapshot" and json.loads(data)["blocks"] == []
            replica.client().completions.create(model=replica.model(), prompt=prompt, max_tokens=1)
            raw_events = []
            for kind, data in events:
                if kind == "kv":
                    raw_events.append(data)
                    stored += [e for e in json.loads(data) if e["type"] == "stored"]
                    if len(stored) >= len(tokens) // 16:
                        break
        assert len(stored) >= len(tokens) // 16 >= 4
        events = [e for data in raw_events for e in json.loads(data)]
        assert_names_only(events, {"seq", "type", "name", "tier"})
        assert {e["tier"] for e in stored} == {"pool"}
        text = httpx.get(replica.url + "/v1/kv/snapshot", headers=operator).text
        snap = json.loads(text)
        assert snap["seq"] == len(snap["blocks"])
        assert_names_only(snap["blocks"], {"name"})
        assert {e["name"] for e in stored} <= {b["name"] for b in snap["blocks"]}
        # No token ids, parents, replica hashes, key digests or tenants' keys, anywhere.
        for body in [text, *raw_events]:
            for word in ("tokens", "parent", '"hash"', "key_digest", TENANT_KEYS[0]):
                assert word not in body, (word, body[:300])
            assert ",".join(map(str, tokens[:16])) not in body
    finally:
        replica.stop()


def test_the_router_evicts_idle_connections_past_its_cap(fleet):
    replicas, _ = fleet
    cap = 64
    router = KuraRouter(replicas, "--max-connections", str(cap))
    flood = []

    def held_by_router() -> int:
        """Client connections the router holds open: its sockets on its own port (not listening)."""
        inodes = set()
        for fd in os.listdir(f"/proc/{router.proc.pid}/fd"):
            try:
                link = os.readlink(f"/proc/{router.proc.pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        n = 0
        for line in pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]:
            f = line.split()
            if int(f[1].split(":")[1], 16) == router.port and f[3] != "0A" and f[9] in inodes:
                n += 1
        return n

    try:
        for _ in range(500):
            flood.append(socket.create_connection(("127.0.0.1", router.port)))
        for _ in range(5):
            assert httpx.get(router.url + "/health", timeout=10).status_code == 200
        deadline = time.time() + 30
        while (held := held_by_router()) > cap:
            assert time.time() < deadline, f"the router holds {held} client connections, cap {cap}"
            time.sleep(0.05)  # poll interval
        assert held_by_router() <= cap
        assert "connection limit reached" in router.log(), router.log()[-2000:]
        # The oldest idle connections were closed to make room: reading them gives end of file.
        closed = closed_by_peer(flood[:300], 2)
        assert closed >= 250, closed
        assert router.proc.poll() is None
    finally:
        for c in flood:
            c.close()
        router.stop()


def test_a_header_trickle_is_cut_after_the_header_timeout(fleet):
    replicas, _ = fleet
    router = KuraRouter(replicas, "--http-header-timeout-s", "1")
    try:
        s = socket.create_connection(("127.0.0.1", router.port))
        s.settimeout(0.2)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        # One header byte every 200 ms keeps the connection busy (never idle) but its head never ends.
        cut = False
        deadline = time.time() + 12
        while time.time() < deadline and not cut:
            try:
                s.sendall(b"x")
                if s.recv(4096) == b"":
                    cut = True
            except socket.timeout:
                pass
            except (BrokenPipeError, ConnectionResetError):
                cut = True
        assert cut, "the router still reads a head that has trickled in for 12 s"
        s.close()
        assert httpx.get(router.url + "/health", timeout=10).status_code == 200
    finally:
        router.stop()


def test_a_body_that_does_not_come_gets_408(fleet):
    replicas, _ = fleet
    router = KuraRouter(replicas, "--http-body-timeout-s", "1")
    try:
        s = socket.create_connection(("127.0.0.1", router.port))
        s.settimeout(30)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 500\r\n\r\n{\"messages\": ")
        head = read_response_head(s)
        s.close()
        assert head.startswith(b"HTTP/1.1 408"), head
        assert router.metrics()["kura_router:tokenized_requests_total"] == 0
    finally:
        router.stop()


def test_requests_without_a_valid_key_get_401_and_are_never_tokenized(keyed_fleet):
    replicas = keyed_fleet
    router = KuraRouter(replicas, "--api-key", TENANT_KEYS[0], "--api-key", TENANT_KEYS[1])
    try:
        model = replicas[0].model()
        doc = "Tokenize me. " + long_text(100, seed=5)
        with pytest.raises(openai.AuthenticationError):
            chat(router.client("wrong"), model, doc, "?")
        r = httpx.post(router.url + "/v1/completions", json={"model": model, "prompt": doc, "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=router.url, api_key="wrong", max_retries=0).messages.create(
                model=model, max_tokens=1, messages=[{"role": "user", "content": doc}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=router.url, api_key="wrong", max_retries=0).messages.count_tokens(
                model=model, messages=[{"role": "user", "content": doc}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
        assert httpx.get(router.url + "/v1/models").status_code == 401
        m = router.metrics()
        assert m["kura_router:unauthorized_total"] == 5
        assert m["kura_router:tokenized_requests_total"] == 0
        assert sum(v for k, v in m.items() if k.startswith("kura_router:requests_total")) == 0
        # A tenant's request is tokenized (the counter counts).
        chat(router.client(TENANT_KEYS[1]), model, doc, "?")
        assert router.metrics()["kura_router:tokenized_requests_total"] == 1
    finally:
        router.stop()


def test_a_flood_of_oversized_unauthenticated_bodies_leaves_every_replica_up(keyed_fleet):
    replicas = keyed_fleet
    router = KuraRouter(replicas, "--api-key", TENANT_KEYS[0], "--api-key", TENANT_KEYS[1])
    try:
        model = replicas[0].model()
        body = b'{"model": "m", "prompt": "' + b"x" * NINE_MIB + b'"}'

        def oversized(i: int):
            path = ("/v1/completions", "/v1/chat/completions", "/v1/messages")[i % 3]
            try:
                return httpx.post(router.url + path, content=body, timeout=60,
                                  headers={"content-type": "application/json"}).status_code
            except httpx.TransportError:
                # The router answers 401 without reading the body and closes: the client may meet the
                # closed connection before it reads the answer.
                return "closed"

        def tenant(i: int):
            return chat(router.client(TENANT_KEYS[i % 2]), model, f"Tenant {i}. " + long_text(40, seed=i), "?")

        with (concurrent.futures.ThreadPoolExecutor(6) as flood_pool,
              concurrent.futures.ThreadPoolExecutor(2) as tenant_pool):
            floods = [flood_pool.submit(oversized, i) for i in range(30)]
            tenants = [tenant_pool.submit(tenant, i) for i in range(8)]
            answers = [f.result(timeout=300) for f in floods]
            served = [f.result(timeout=300) for f in tenants]
        assert set(answers) <= {401, "closed"}, answers
        assert len(served) == 8
        m = router.metrics()
        assert m["kura_router:unauthorized_total"] == 30
        # Only the tenants' requests were tokenized (or, with every tokenizer slot busy, routed by load).
        assert m["kura_router:tokenized_requests_total"] + m["kura_router:tokenizer_busy_total"] == 8
        assert sum(v for k, v in m.items() if k.startswith("kura_router:request_failures_total")) == 0
        assert_every_replica_up(router, replicas)
    finally:
        router.stop()


def test_an_oversized_body_gets_413_from_the_router_itself(keyed_fleet):
    replicas = keyed_fleet
    router = KuraRouter(replicas, "--api-key", TENANT_KEYS[0])
    try:
        for path, shape in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
            # The head announces 9 MiB; the router answers from the head, without reading a byte more.
            s = socket.create_connection(("127.0.0.1", router.port))
            s.settimeout(30)
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Authorization: Bearer {TENANT_KEYS[0]}\r\nConnection: close\r\n"
                      f"Content-Length: {NINE_MIB}\r\n\r\n{{".encode())
            answer = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                answer += chunk
            s.close()
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 413"), answer
            assert b"x-kura-replica" not in head.lower()
            error = json.loads(payload)
            if shape == "openai":
                assert error["error"]["code"] == "request_too_large", error
            else:
                assert error["type"] == "error" and error["error"]["type"] == "request_too_large", error
        m = router.metrics()
        assert sum(v for k, v in m.items() if k.startswith("kura_router:requests_total")) == 0
        assert m["kura_router:tokenized_requests_total"] == 0
        assert_every_replica_up(router, replicas)
    finally:
        router.stop()


def test_a_replica_that_refuses_a_body_is_not_drained(fleet):
    replicas, _ = fleet
    # The router takes bodies the replicas (8 MiB) refuse: a replica reads 8 MiB, answers 413 and closes
    # the connection on the rest, which the router, still sending, often sees as a broken connection
    # (about a third of the time at 24 MiB here; at 9 MiB, one in thirty).
    router = KuraRouter(replicas, "--max-body-size", "32MiB", "--policy", "round-robin")
    try:
        model = replicas[0].model()
        body = json.dumps({"model": model, "prompt": "x" * (24 << 20), "max_tokens": 1}).encode()

        def oversized(_):
            r = httpx.post(router.url + "/v1/completions", content=body, timeout=60,
                           headers={"content-type": "application/json"})
            return r.status_code

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(oversized, range(30)))
        print(f"\n30 bodies of 24 MiB refused by the replicas: {answers.count(413)} x 413 forwarded, "
              f"{answers.count(502)} x 502 (connection closed by a live replica)")
        assert set(answers) <= {413, 502}, answers
        assert_every_replica_up(router, replicas)
        assert router.metrics()["kura_router:retries_total"] == 0
        # Both replicas still serve.
        seen = {chat(router.client(), model, "After the refusals.", f"Question {i}?")[0] for i in range(4)}
        assert seen == {0, 1}
    finally:
        router.stop()


def test_a_stream_cut_by_a_killed_replica_ends_with_an_error_event():
    replicas = [KuraServer(*replica_args()) for _ in range(2)]
    router = KuraRouter(replicas, "--policy", "least-load")
    try:
        model = replicas[0].model()
        long_run = {"max_tokens": 2000, "temperature": 0}
        # OpenAI: the client raises the error event's message (never a silently short stream).
        stream = router.client().chat.completions.with_raw_response.create(
            model=model, stream=True, extra_body={"ignore_eos": True}, **long_run,
            messages=[{"role": "user", "content": "Tell a long story."}])
        victim = replicas[int(stream.headers["x-kura-replica"])]
        chunks = iter(stream.parse())
        next(chunks)
        victim.proc.send_signal(signal.SIGKILL)
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:
                pass
        assert type(e.value) is openai.APIError and "failed mid-stream" in str(e.value), repr(e.value)
        router.wait_metric(lambda m: m["kura_router:replica_up" + label(victim)] == 0, timeout=30)
        # Anthropic: an `error` event of type api_error ends the stream, which ends cleanly.
        survivor = next(r for r in replicas if r is not victim)
        with httpx.stream("POST", router.url + "/v1/messages", timeout=60, json={
            "model": model, "stream": True, **long_run,
            "messages": [{"role": "user", "content": "Tell another long story."}],
        }) as r:
            assert r.status_code == 200 and r.headers["x-kura-replica"] == str(replicas.index(survivor))
            events = []
            for kind, data in sse_events(r.iter_lines()):
                events.append((kind, json.loads(data)))
                if kind == "content_block_delta" and survivor.proc.poll() is None:
                    survivor.proc.send_signal(signal.SIGKILL)
        kind, data = events[-1]
        assert kind == "error" and data["type"] == "error" and data["error"]["type"] == "api_error", events[-3:]
        assert "failed mid-stream" in data["error"]["message"]
        assert any(k == "content_block_delta" for k, _ in events)
    finally:
        router.stop()
        for r in replicas:
            r.stop(signal.SIGKILL)


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "--replica"),
        (["--replica", "localhost:8001"], "give http://HOST:PORT"),
        (["--replica", "http://127.0.0.1:1", "--replica", "http://127.0.0.1:1/"], "given twice"),
        (["--replica", "http://127.0.0.1:1", "--replica", "HTTP://127.0.0.1:1"], "given twice"),
        (["--replica", "http://u:p@127.0.0.1:1"], "holds a user or password"),
        (["--replica", "http://127.0.0.1:1/v1"], "has a path (/v1)"),
        (["--replica", "http://127.0.0.1:1?x=1"], "has a query or fragment"),
        (["--replica", "http://127.0.0.1:1", "--policy", "random"], "round-robin"),
        (["--replica", "http://127.0.0.1:1", "--overlap-weight", "nan"], "--overlap-weight"),
        (["--replica", "http://127.0.0.1:1", "--health-interval-ms", "0"], "--health-interval-ms"),
        (["--replica", "http://127.0.0.1:1"], "--fleet-secret-file"),
        (["--replica", "http://127.0.0.1:1", "--fleet-secret-file", "SECRET"], "--replica-admin-key-file"),
        (["--replica", "http://127.0.0.1:1", "--policy", "round-robin", "--max-body-size", "0"], "--max-body-size"),
        (["--replica", "http://127.0.0.1:1", "--policy", "round-robin", "--tokenizer-threads", "1"],
         "--tokenizer-threads"),
        (["--replica", "http://127.0.0.1:1", "--policy", "round-robin", "--max-connections", "100000000"],
         "--max-connections"),
        (["--replica", "http://127.0.0.1:1", "--policy", "round-robin", "--http-header-timeout-s", "0"],
         "--http-header-timeout-s"),
        (["--replica", "http://127.0.0.1:1", "--replica-api-key", "k"], "--replica-api-key"),
    ],
)
def test_bad_router_flags_are_refused_by_name(args, message):
    args = [fleet_files()[0] if a == "SECRET" else a for a in args]
    proc = subprocess.run([kura_bin(), "router", "--model", model_path(), "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=60, env=clean_env())
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert "routing the OpenAI" not in proc.stderr
