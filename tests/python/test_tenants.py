"""Tenants stay apart on one server: the operator scope, KV events without tokens, keyed names, saved
contexts (private files, per-tenant quotas, a full disk), pins, and the cache clock.

Real `kura serve` processes on the default model, real HTTP. Block and tenant names are recomputed here
from the fleet secret with BLAKE3 exactly as Kura computes them, so that a test sees that the names a
replica publishes are the keyed ones a router computes, and that nothing else is published.
"""

import concurrent.futures
import json
import os
import pathlib
import stat
import subprocess
import tempfile

import anthropic
import blake3
import httpx
import pytest
import xxhash

from conftest import BLOCK, KuraServer, kura_bin, long_text, model_path

KEY_A, KEY_B, OPERATOR = "tenant-a-key", "tenant-b-key", "operator-key-0123"
FLEET_SECRET = "f" * 16 + "0123456789abcdef" * 3


def bearer(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def secret_file(tmp: pathlib.Path, text: str = FLEET_SECRET) -> str:
    p = tmp / "fleet.secret"
    p.write_text(text + "\n")
    p.chmod(0o600)
    return str(p)


# --- Kura's names, recomputed (crates/kura-kv/src/hash.rs, crates/kura-server/src/lib.rs) ---

def secret_of_text(text: str) -> bytes:
    return blake3.blake3(text.strip().encode(), derive_key_context="kura 2026 secret text").digest()


def derive(secret: bytes, purpose: str) -> bytes:
    return blake3.blake3(secret, derive_key_context=purpose).digest()


def tenant_name(secret: bytes, api_key: str) -> str:
    key = derive(secret, "kura 2026 tenant names of api keys")
    return "key-" + blake3.blake3(api_key.encode(), key=key).digest()[:16].hex()


def mac128(key: bytes, data: bytes) -> int:
    return int.from_bytes(blake3.blake3(data, key=key).digest()[:16], "little")


def block_names(secret: bytes, salt: str | None, fingerprint: str, tokens: list[int]) -> list[str]:
    """The names of the whole blocks of `tokens` under the cache key (salt, no adapter, fingerprint)."""
    key = derive(secret, "kura 2026 kv block content names")
    enc = bytearray([0])
    for tag, field in ((1, salt), (2, None), (3, fingerprint)):
        if field is None:
            enc.append(0)
        else:
            b = field.encode()
            enc += bytes([tag]) + len(b).to_bytes(8, "little") + b
    parent = mac128(key, bytes(enc))
    names = []
    for i in range(len(tokens) // BLOCK):
        data = b"\x01" + parent.to_bytes(16, "little") + b"".join(
            t.to_bytes(4, "little") for t in tokens[i * BLOCK:(i + 1) * BLOCK])
        parent = mac128(key, data)
        names.append(f"{parent:032x}")
    return names


# --- a server with two tenants and an operator ---

@pytest.fixture(scope="module")
def op(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("op")
    disk = tmp / "disk"
    s = KuraServer("--api-key", KEY_A, "--api-key", KEY_B, "--admin-api-key", OPERATOR,
                   "--fleet-secret-file", secret_file(tmp), "--kv-events", "--debug-clock",
                   "--kv-disk-path", str(disk), "--kv-disk-size", "64MiB",
                   "--max-contexts-per-tenant", "2", "--max-kv-event-streams", "2",
                   "--kv-cache-memory", "64MiB", api_key=KEY_A)
    s.disk = disk
    yield s
    s.stop()


OPERATOR_ROUTES = [("GET", "/v1/kv/snapshot", None), ("POST", "/debug/clock", {"advance_s": 0})]


@pytest.mark.parametrize("method,path,body", OPERATOR_ROUTES)
def test_operator_routes_answer_the_operator_key_only(op, method, path, body):
    for key, status in ((KEY_A, 403), (KEY_B, 403), (None, 401), ("wrong", 401), (OPERATOR, 200)):
        r = httpx.request(method, op.url + path, json=body, headers=bearer(key), timeout=10)
        assert r.status_code == status, (key, r.text)
        if status == 403:
            assert r.json()["error"]["code"] == "operator_only"
    # The event stream too (its status only).
    for key, status in ((KEY_A, 403), (None, 401), (OPERATOR, 200)):
        with httpx.stream("GET", op.url + "/v1/kv/events", headers=bearer(key), timeout=10) as r:
            assert r.status_code == status, key
    # And the operator key is no tenant, which the answer says (not an invalid key), on the Anthropic
    # route in Anthropic's shape.
    r = httpx.post(op.url + "/v1/completions", headers=bearer(OPERATOR),
                   json={"model": op.model(), "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_only", r.text
    assert "takes a tenant's API key" in r.json()["error"]["message"], r.text
    r = httpx.post(op.url + "/v1/messages", headers={"x-api-key": OPERATOR},
                   json={"model": op.model(), "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text


def test_operator_routes_are_off_without_an_operator_key():
    s = KuraServer("--api-key", KEY_A, "--kv-cache-memory", "64MiB", api_key=KEY_A)
    try:
        for method, path, body in OPERATOR_ROUTES:
            r = httpx.request(method, s.url + path, json=body, headers=bearer(KEY_A), timeout=10)
            assert r.status_code == 404, r.text
    finally:
        s.stop()


@pytest.mark.parametrize("args,message", [
    (("--kv-events", "--fleet-secret-file", "{secret}"), "operator key"),
    (("--debug-clock",), "operator key"),
    (("--kv-events", "--admin-api-key", OPERATOR), "fleet's secret"),
    (("--kv-events", "--admin-api-key", OPERATOR, "--fleet-secret-file", "{short}"), "at least 32"),
    (("--admin-api-key", KEY_A, "--api-key", KEY_A), "also a tenant's API key"),
])
def test_operator_and_fleet_flags_are_checked_at_start(tmp_path, args, message):
    short = tmp_path / "short.secret"
    short.write_text("tiny")
    args = [a.format(secret=secret_file(tmp_path), short=short) for a in args]
    env = {k: v for k, v in os.environ.items() if k not in ("KURA_FLEET_SECRET", "KURA_ADMIN_API_KEY")}
    r = subprocess.run([kura_bin(), "serve", "--model", model_path(), "--port", "0", *args],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


def tokens_of(server: KuraServer, key: str, prompt: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, headers=bearer(key))
    r.raise_for_status()
    return r.json()["tokens"]


def complete(server: KuraServer, key: str, prompt: str) -> dict:
    r = httpx.post(server.url + "/v1/completions", headers=bearer(key), timeout=120,
                   json={"model": server.model(), "prompt": prompt, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return r.json()


def snapshot(server: KuraServer) -> dict:
    r = httpx.get(server.url + "/v1/kv/snapshot", headers=bearer(OPERATOR), timeout=10)
    r.raise_for_status()
    return r.json()


def test_kv_events_name_blocks_by_keyed_content_and_carry_no_tokens(op):
    secret = secret_of_text(FLEET_SECRET)
    prompt = long_text(120, seed=71)
    tokens = tokens_of(op, KEY_A, prompt)
    assert len(tokens) >= 4 * BLOCK
    fingerprint = snapshot(op)["model_fingerprint"]
    want_a = block_names(secret, tenant_name(secret, KEY_A), fingerprint, tokens)
    want_b = block_names(secret, tenant_name(secret, KEY_B), fingerprint, tokens)
    # B's request for the same text arrives while the operator reads the stream.
    with httpx.stream("GET", op.url + "/v1/kv/events", headers=bearer(OPERATOR), timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(lines) == "event: snapshot"
        complete(op, KEY_A, prompt)
        complete(op, KEY_B, prompt)
        stored = []
        event = None
        for line in lines:
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "kv":
                for e in json.loads(line[6:]):
                    assert set(e) <= {"seq", "type", "name", "tier"}, e
                    if e["type"] == "stored":
                        stored.append(e["name"])
            if set(want_b[:-1]) <= set(stored):
                break
    assert set(want_a[:-1]) <= set(stored), "A's blocks were announced by their keyed names"
    snap = snapshot(op)
    names = {b["name"] for b in snap["blocks"]}
    assert set(want_a[:-1]) | set(want_b[:-1]) <= names
    for b in snap["blocks"]:
        assert set(b) == {"name"}, b
    text = json.dumps(snap)
    for word in ("tokens", "parent", "key_digest", "hash", tenant_name(secret, KEY_A), KEY_A, OPERATOR):
        assert word not in text
    # Another fleet secret names the same blocks otherwise: names are no unkeyed digest of the tokens.
    other = secret_of_text("another fleet secret of at least thirty-two chars")
    assert not set(block_names(other, tenant_name(other, KEY_A), fingerprint, tokens)) & names


def test_kv_events_tokens_are_an_operator_debug_flag(tmp_path):
    s = KuraServer("--admin-api-key", OPERATOR, "--fleet-secret-file", secret_file(tmp_path),
                   "--kv-events", "--kv-events-tokens", "--kv-cache-memory", "64MiB")
    try:
        prompt = long_text(60, seed=72)
        tokens = tokens_of(s, "unused", prompt)
        complete(s, "unused", prompt)
        blocks = snapshot(s)["blocks"]
        assert tokens[:BLOCK] in [b["tokens"] for b in blocks]
    finally:
        s.stop()


def test_event_streams_are_capped(op):
    with httpx.Client(timeout=10) as c:
        with c.stream("GET", op.url + "/v1/kv/events", headers=bearer(OPERATOR)) as one, \
                c.stream("GET", op.url + "/v1/kv/events", headers=bearer(OPERATOR)) as two:
            assert (one.status_code, two.status_code) == (200, 200)
            r = c.get(op.url + "/v1/kv/events", headers=bearer(OPERATOR))
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_streams"
    # Closed streams give their places back (the server sees the close on its next write).
    for _ in range(100):
        with httpx.stream("GET", op.url + "/v1/kv/events", headers=bearer(OPERATOR), timeout=10) as r:
            if r.status_code == 200:
                break
    assert r.status_code == 200


def create_context(server: KuraServer, key: str, seed: int) -> httpx.Response:
    return httpx.post(server.url + "/v1/caches", headers=bearer(key), timeout=120,
                      json={"prompt": long_text(40, seed=seed), "ttl": "1h"})


def test_saved_contexts_are_private_files_with_a_quota_per_tenant(op):
    ids = []
    for seed in (80, 81):
        r = create_context(op, KEY_A, seed)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    r = create_context(op, KEY_A, 82)
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_caches", r.text
    # B's quota is its own.
    r = create_context(op, KEY_B, 83)
    assert r.status_code == 200, r.text
    assert [c["id"] for c in httpx.get(op.url + "/v1/caches", headers=bearer(KEY_B)).json()["data"]] \
        == [r.json()["id"]]
    contexts = op.disk / "contexts"
    assert stat.S_IMODE(contexts.stat().st_mode) & 0o077 == 0
    files = sorted(contexts.glob("*.json"))
    assert len(files) == 3
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    for cid in ids:
        assert httpx.delete(op.url + f"/v1/caches/{cid}", headers=bearer(KEY_A)).status_code == 200
        assert not (contexts / f"{cid}.json").exists()


def test_the_cache_clock_is_the_operators_and_bounded(op):
    r = httpx.post(op.url + "/debug/clock", json={"advance_s": 10 ** 12}, headers=bearer(OPERATOR))
    assert r.status_code == 400 and "advance_s" in r.text
    r = httpx.post(op.url + "/debug/clock", json={"advance_s": 10}, headers=bearer(OPERATOR))
    assert r.status_code == 200
    # A tenant's saved context outlives any tenant's attempt to move the clock.
    r = create_context(op, KEY_B, 84)
    assert r.status_code == 200, r.text
    cid = r.json()["id"]
    for key in (KEY_A, KEY_B):
        assert httpx.post(op.url + "/debug/clock", json={"advance_s": 7200}, headers=bearer(key)).status_code == 403
    assert httpx.get(op.url + f"/v1/caches/{cid}", headers=bearer(KEY_B)).status_code == 200
    httpx.delete(op.url + f"/v1/caches/{cid}", headers=bearer(KEY_B))


# --- tenant names: keyed, kept across restarts and key order, older owners migrated ---

def test_tenant_names_are_keyed_kept_across_restarts_and_older_owners_move(tmp_path):
    disk = tmp_path / "disk"
    s = KuraServer("--api-key", KEY_A, "--kv-disk-path", str(disk), "--kv-disk-size", "64MiB",
                   "--kv-cache-memory", "64MiB", api_key=KEY_A)
    try:
        r = create_context(s, KEY_A, 90)
        assert r.status_code == 200, r.text
        first = r.json()["id"]
    finally:
        s.stop()
    secret_path = disk / "server.secret"
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600
    server_secret = secret_path.read_bytes()
    assert len(server_secret) == 32
    record = json.loads((disk / "contexts" / f"{first}.json").read_text())
    # The owner is the keyed digest of the key under the server's secret, not the unkeyed one.
    legacy = f"key-{xxhash.xxh3_64_intdigest(KEY_A.encode()):016x}"
    assert record["tenant"] == tenant_name(server_secret, KEY_A) != legacy
    # A context saved by an earlier version names its owner by the unkeyed digest: it moves to the key's
    # keyed name at start.
    old_id = "ctx_" + "0123456789abcdef01234567"
    record.update(id=old_id, tenant=legacy, display_name="older")
    (disk / "contexts" / f"{old_id}.json").write_text(json.dumps(record))
    s = KuraServer("--api-key", KEY_B, "--api-key", KEY_A, "--kv-disk-path", str(disk),
                   "--kv-disk-size", "64MiB", "--kv-cache-memory", "64MiB", api_key=KEY_A)
    try:
        mine = {c["id"] for c in httpx.get(s.url + "/v1/caches", headers=bearer(KEY_A)).json()["data"]}
        assert mine == {first, old_id}
        assert httpx.get(s.url + "/v1/caches", headers=bearer(KEY_B)).json()["data"] == []
        moved = json.loads((disk / "contexts" / f"{old_id}.json").read_text())
        assert moved["tenant"] == tenant_name(server_secret, KEY_A)
        assert stat.S_IMODE((disk / "contexts" / f"{old_id}.json").stat().st_mode) == 0o600
        out = s.client().completions.create(model=s.model(), prompt=" next", max_tokens=1, temperature=0,
                                            extra_body={"cached_content": old_id})
        assert out.usage.prompt_tokens > 40
    finally:
        s.stop()


# --- pins: one tenant's pins never push out another's ---

def system_text(server: KuraServer, tokens_wanted: int, seed: int) -> str:
    words = tokens_wanted
    while True:
        text = long_text(words, seed=seed)
        if len(tokens_of(server, KEY_A, text)) >= tokens_wanted:
            return text
        words += tokens_wanted // 4


def test_one_tenants_pins_do_not_push_out_anothers():
    # 91 blocks in the pool; pins may hold 45.
    s = KuraServer("--api-key", KEY_A, "--api-key", KEY_B, "--kv-cache-memory", "32MiB",
                   "--kv-pin-budget", "50%", api_key=KEY_A)
    try:
        model = s.model()

        def pin(key: str, system: str):
            client = anthropic.Anthropic(base_url=s.url, api_key=key, max_retries=0)
            blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
            return client.messages.create(model=model, max_tokens=1, extra_body={"temperature": 0},
                                          system=blocks, messages=[{"role": "user", "content": "Hi."}]).usage

        a_system = system_text(s, 320, seed=100)  # 20 blocks
        assert pin(KEY_A, a_system).cache_creation_input_tokens >= 304
        # B pins three prefixes of 20 blocks: more than the budget left, so pins are demoted.
        for seed in (101, 102, 103):
            pin(KEY_B, system_text(s, 320, seed=seed))
        assert s.metrics()["kura:kv_pins_demoted_total"] >= 1
        # Ten pools of B's unique traffic evict whatever is not pinned.
        pool_tokens = s.metrics()["kura:kv_cache_blocks_total"] * BLOCK
        oa = s.client(api_key=KEY_B)
        sent, i = 0, 0
        while sent < 10 * pool_tokens:
            out = oa.completions.create(model=model, prompt=f"{i} " + long_text(300, seed=2000 + i),
                                        max_tokens=1, temperature=0)
            sent += out.usage.prompt_tokens
            i += 1
        assert pin(KEY_A, a_system).cache_read_input_tokens >= 304, "A's pin stayed in the pool"
    finally:
        s.stop()


# --- a full disk ---

def test_a_full_disk_is_a_clear_507_without_the_servers_paths():
    mount = pathlib.Path(tempfile.mkdtemp(prefix="kura-full-disk-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True,
                       text=True)
    assert r.returncode == 0, f"mounting a small tmpfs for the full-disk test failed (needs root): {r.stderr}"
    s = None
    try:
        s = KuraServer("--api-key", KEY_A, "--kv-disk-path", str(mount / "disk"), "--kv-disk-size", "1MiB",
                       "--kv-cache-memory", "64MiB", api_key=KEY_A)
        filler = mount / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        r = create_context(s, KEY_A, 95)
        assert r.status_code == 507, r.text
        assert r.json()["error"]["code"] == "insufficient_storage"
        assert str(mount) not in r.text and "/" not in r.json()["error"]["message"].replace("/v1", "")
        filler.unlink()
        r = create_context(s, KEY_A, 95)
        assert r.status_code == 200, r.text
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        if s is not None:
            s.stop()
        subprocess.run(["umount", str(mount)], check=False)
        mount.rmdir()


def test_ids_a_tenant_gets_back_count_nothing(op):
    """Response ids were a server-wide counter and the time: the gap between two of a tenant's own ids
    was how many requests the other tenants made in between. Now they are random."""
    ids = {"cmpl": [], "chatcmpl": [], "msg": [], "resp": []}
    for i in range(12):
        r = httpx.post(op.url + "/v1/completions", headers=bearer(KEY_A), timeout=60,
                       json={"prompt": "Hi", "max_tokens": 1})
        ids["cmpl"].append(r.json()["id"])
        if i % 3 == 0:
            # Another tenant's traffic in between.
            httpx.post(op.url + "/v1/completions", headers=bearer(KEY_B), timeout=60,
                       json={"prompt": "Hi", "max_tokens": 1}).raise_for_status()
    ids["chatcmpl"].append(httpx.post(op.url + "/v1/chat/completions", headers=bearer(KEY_A), timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).json()["id"])
    ids["msg"].append(httpx.post(op.url + "/v1/messages", headers={"x-api-key": KEY_A}, timeout=60, json={
        "model": op.model(), "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}).json()["id"])
    ids["resp"].append(httpx.post(op.url + "/v1/responses", headers=bearer(KEY_A), timeout=60, json={
        "input": "Hi", "max_output_tokens": 1, "store": False}).json()["id"])
    for prefix, got in ids.items():
        sep = "_" if prefix == "resp" else "-"
        for i in got:
            head, _, digits = i.partition(sep)
            assert head == prefix and len(digits) == 24 and int(digits, 16) >= 0, i
    values = [int(i.split("-")[1], 16) for i in ids["cmpl"]]
    # Twelve random values in increasing order: one chance in 12! (a counter always is).
    assert values != sorted(values), ids["cmpl"]
    assert len(set(values)) == len(values)


def test_a_salt_cannot_pose_as_another_tenants(op):
    r = httpx.post(op.url + "/v1/completions", headers=bearer(KEY_A), timeout=60,
                   json={"prompt": "Hi", "max_tokens": 1, "cache_salt": "key-b\u001fx"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt" and "U+001F" in r.json()["error"]["message"]


GRAMMAR_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
                  "properties": {"city": {"type": "string", "maxLength": 12}}}


def grammar_request(route: str, name: str) -> tuple[str, dict]:
    """A request of `route` whose output follows a grammar of its own (`name` in it)."""
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    fn = {"name": name, "strict": True, "parameters": GRAMMAR_SCHEMA}
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": GRAMMAR_SCHEMA}}
    return {
        "chat": ("/v1/chat/completions", {"messages": ask, "tools": [{"type": "function", "function": fn}],
                                          "tool_choice": "required"}),
        "completions": ("/v1/completions", {"prompt": "Weather in Oslo as JSON:", "response_format": fmt}),
        "messages": ("/v1/messages", {"messages": ask, "tool_choice": {"type": "any"},
                                      "tools": [{"name": name, "input_schema": GRAMMAR_SCHEMA}]}),
        "responses": ("/v1/responses", {"input": "Weather in Oslo?", "store": False, "tool_choice": "required",
                                        "tools": [{"type": "function"} | fn]}),
    }[route]


@pytest.mark.parametrize("route", ["chat", "completions", "messages", "responses"])
def test_a_tenant_reuses_its_own_compiled_grammar_and_never_anothers(op, route):
    # An agent sends the same strict tools (or format) every turn: the second turn reuses the grammar
    # compiled for the first (the same output), but only within a tenant and its cache salt —
    # another's identical request compiles its own, so that neither can time the other's grammars.
    path, body = grammar_request(route, f"weather_{route}")
    limit = "max_output_tokens" if route == "responses" else "max_tokens"
    body = body | {"model": op.model(), limit: 40, "temperature": 0}

    def counts():
        m = op.metrics()
        return m["kura:grammar_compiles_total"], m["kura:grammar_reuses_total"]

    def ask(key: str, extra: dict | None = None):
        headers = bearer(key) | ({"x-api-key": key, "anthropic-version": "2023-06-01"}
                                 if route == "messages" else {})
        r = httpx.post(op.url + path, headers=headers, json=body | (extra or {}), timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        # What the grammar held: the call's arguments, or the text.
        match route:
            case "chat":
                return [c["function"] for c in out["choices"][0]["message"]["tool_calls"]]
            case "completions":
                return out["choices"][0]["text"]
            case "messages":
                return [b["input"] for b in out["content"] if b["type"] == "tool_use"]
            case _:
                return [o["arguments"] for o in out["output"] if o["type"] == "function_call"]

    c0, r0 = counts()
    first = ask(KEY_A)
    assert first and counts() == (c0 + 1, r0)
    assert ask(KEY_A) == first
    assert counts() == (c0 + 1, r0 + 1)
    # Another tenant, and the same tenant under another cache salt: compiled again.
    assert ask(KEY_B) == first
    assert counts() == (c0 + 2, r0 + 1)
    ask(KEY_A, {"cache_salt": "elsewhere"})
    assert counts() == (c0 + 3, r0 + 1)


def test_a_tenant_s_requests_for_one_grammar_at_once_compile_it_once(op):
    # An agent's parallel turns send the same tools at once: one compiles the grammar, the others
    # wait for it (or find it kept). Another tenant's identical requests at the same time compile
    # their own, once.
    path, body = grammar_request("chat", "weather_at_once")
    body = body | {"model": op.model(), "max_tokens": 40, "temperature": 0}
    m = op.metrics()
    c0, r0 = m["kura:grammar_compiles_total"], m["kura:grammar_reuses_total"]

    def ask(key: str):
        r = httpx.post(op.url + path, headers=bearer(key), json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["tool_calls"][0]["function"]

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        calls = list(pool.map(ask, [KEY_A, KEY_B] * 6))
    assert all(c == calls[0] for c in calls), calls
    m = op.metrics()
    assert (m["kura:grammar_compiles_total"], m["kura:grammar_reuses_total"]) == (c0 + 2, r0 + 10)
