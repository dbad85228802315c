"""A fleet: `kura serve --kv-events` replicas behind `kura router`, driven by the official clients.

What is tested: the router sends a shared prefix to the replica that holds it (KV events → index →
cost), tenants' keys keep their prefixes apart in the router's index as in the replicas, a replica killed
with SIGKILL in the middle of a run is drained and every request in flight there is sent again to the
survivor, an event gap makes the router resynchronize from a snapshot, and the Anthropic API goes through.
"""

import concurrent.futures
import os
import pathlib
import signal
import subprocess
import tempfile
import time

import anthropic
import httpx
import openai
import pytest

from conftest import KuraServer, free_port, kura_bin, long_text, model_path, prometheus, wait_healthy

REPLICA_ARGS = ("--kv-events", "--threads", "1", "--kv-cache-memory", "64MiB")


class KuraRouter:
    """One `kura router` process on a free port over `replicas`."""

    def __init__(self, replicas: list[KuraServer], *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = tempfile.NamedTemporaryFile(prefix="kura-router-", suffix=".log", delete=False)
        cmd = [kura_bin(), "router", "--model", model_path(), "--port", str(self.port)]
        for r in replicas:
            cmd += ["--replica", r.url]
        self.proc = subprocess.Popen([*cmd, *args], stdout=self.log_file, stderr=subprocess.STDOUT)
        if not wait_healthy(self.proc, self.url, "kura router", self.log, 60):
            self.stop()
            raise RuntimeError(f"kura router did not become healthy:\n{self.log()}")
        # The first snapshot of every replica, so that routing sees their caches from the first request.
        self.wait_metric(lambda m: all(m[f'kura_router:kv_snapshots_total{{replica="{r.url}"}}'] >= 1 for r in replicas))

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


@pytest.fixture(scope="module")
def fleet():
    replicas = [KuraServer(*REPLICA_ARGS) for _ in range(2)]
    router = KuraRouter(replicas)
    yield replicas, router
    router.stop()
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


def test_tenants_prefixes_stay_apart_in_the_index(tmp_path):
    keys = ("key-a", "key-b")
    replicas = [KuraServer(*REPLICA_ARGS, "--api-key", keys[0], "--api-key", keys[1], api_key=keys[0]) for _ in range(2)]
    router = KuraRouter(replicas, "--replica-api-key", keys[0])
    try:
        model = replicas[0].model()
        doc = "Shared text. " + long_text(150, seed=7)
        a = router.client(keys[0])
        b = router.client(keys[1])
        ra, _, _ = chat(a, model, doc, "First?")
        ra2, cached_a, prompt = chat(a, model, doc, "Second?")
        assert ra2 == ra and cached_a >= prompt - 32
        # Tenant b's blocks are salted apart: the router predicts no hit for b on a's replica...
        before = router.metrics()
        rb, cached_b, _ = chat(b, model, doc, "Second?")
        assert cached_b == 0
        after = router.metrics()
        url = replicas[rb].url
        key = f'kura_router:predicted_cached_tokens_total{{replica="{url}"}}'
        assert after[key] == before[key]
        # ...and a wrong key is refused by the replica, through the router.
        with pytest.raises(openai.AuthenticationError):
            chat(router.client("wrong"), model, doc, "?")
    finally:
        router.stop()
        for r in replicas:
            r.stop()


def test_a_killed_replica_is_drained_and_every_request_ends():
    replicas = [KuraServer(*REPLICA_ARGS) for _ in range(2)]
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
            # Kill the victim once it has answered a request and is in the middle of others, whatever the
            # machine's speed: the router has then routed to it and has requests in flight there.
            def victim_is_busy() -> bool:
                served = router.metrics()[f'kura_router:requests_total{{replica="{victim.url}"}}']
                return served >= 1 and victim.metrics()["kura:num_requests_running"] >= 1

            deadline = time.time() + 120
            while not victim_is_busy():
                assert time.time() < deadline, f"the victim never served and ran requests at once:\n{victim.log()[-2000:]}"
                assert not any(f.done() and f.exception() for f in futures), [f.exception() for f in futures if f.done()]
                time.sleep(0.01)  # poll interval
            victim.proc.send_signal(signal.SIGKILL)
            router.wait_metric(lambda m: m[f'kura_router:replica_up{{replica="{victim.url}"}}'] == 0, timeout=60)
            # A hang would be a failure: the timeout only turns it into one.
            results = [f.result(timeout=300) for f in futures]
        # Every request ends with its full answer: a request in flight on the killed replica had received
        # nothing yet (a non-streamed answer comes whole), so the router sent it again to the survivor.
        assert [n for _, n in results] == [max_tokens] * 24
        m = router.metrics()
        assert m["kura_router:retries_total"] >= 1, "no request in flight on the killed replica was retried"
        served_by_victim = m[f'kura_router:requests_total{{replica="{victim.url}"}}']
        assert served_by_victim >= 1
        assert sum(1 for r, _ in results if r == 1) == served_by_victim
        # After the drain, every request goes to the survivor and succeeds.
        for i in range(4):
            replica, _, _ = chat(client, model, "After the kill.", f"Question {i}?")
            assert replica == 0
        assert router.metrics()[f'kura_router:requests_total{{replica="{victim.url}"}}'] == served_by_victim
    finally:
        router.stop()
        for r in replicas:
            r.stop(signal.SIGKILL)


def test_an_event_gap_makes_the_router_resynchronize():
    # A ring of 2 events: one long prompt announces more blocks than that in one step.
    replica = KuraServer(*REPLICA_ARGS, "--kv-events-buffer", "2")
    router = KuraRouter([replica])
    try:
        model = replica.model()
        client = router.client()
        doc = "Gap. " + long_text(200, seed=3)
        chat(client, model, doc, "First?")
        label = f'{{replica="{replica.url}"}}'
        m = router.wait_metric(lambda m: m["kura_router:kv_event_gaps_total" + label] >= 1
                               and m["kura_router:kv_snapshots_total" + label] >= 2
                               and m["kura_router:indexed_blocks" + label] >= 10)
        # The index rebuilt from the new snapshot predicts the next request's hit.
        before = m["kura_router:predicted_cached_tokens_total" + label]
        _, cached, prompt = chat(client, model, doc, "Second?")
        after = router.metrics()["kura_router:predicted_cached_tokens_total" + label]
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


def test_kv_events_endpoints_need_the_flag_and_the_key():
    plain = KuraServer("--threads", "1", "--kv-cache-memory", "32MiB")
    keyed = KuraServer(*REPLICA_ARGS, "--api-key", "secret", api_key="secret")
    try:
        r = httpx.get(plain.url + "/v1/kv/snapshot")
        assert r.status_code == 404 and "--kv-events" in r.text
        assert httpx.get(keyed.url + "/v1/kv/snapshot").status_code == 401
        snap = httpx.get(keyed.url + "/v1/kv/snapshot", headers=keyed.headers()).json()
        assert snap["tenants"] is True and snap["block_size"] == 16 and snap["blocks"] == []
        keyed.client().completions.create(model=keyed.model(), prompt=long_text(60), max_tokens=1)
        snap = httpx.get(keyed.url + "/v1/kv/snapshot", headers=keyed.headers()).json()
        roots = [b for b in snap["blocks"] if b["parent"] is None]
        assert len(roots) == 1 and roots[0]["key_digest"] and len(roots[0]["tokens"]) == 16
        assert snap["seq"] == len(snap["blocks"])
        # The salt itself (the tenant's key) appears nowhere.
        assert "secret" not in httpx.get(keyed.url + "/v1/kv/snapshot", headers=keyed.headers()).text
    finally:
        plain.stop()
        keyed.stop()


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "--replica"),
        (["--replica", "localhost:8001"], "must be http://HOST:PORT"),
        (["--replica", "http://127.0.0.1:1", "--replica", "http://127.0.0.1:1/"], "given twice"),
        (["--replica", "http://127.0.0.1:1", "--policy", "random"], "round-robin"),
        (["--replica", "http://127.0.0.1:1", "--overlap-weight", "nan"], "--overlap-weight"),
        (["--replica", "http://127.0.0.1:1", "--health-interval-ms", "0"], "--health-interval-ms"),
    ],
)
def test_bad_router_flags_are_refused_by_name(args, message):
    proc = subprocess.run([kura_bin(), "router", "--model", model_path(), "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert "routing the OpenAI" not in proc.stderr
