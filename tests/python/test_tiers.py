"""The lower KV tiers through the API, on real processes: the host tier (L2) and the disk tier (L3).

Blocks evicted from the pool are found again in the host and disk tiers (`cached_tokens`, per-tier
metrics) and give the same greedy output as a cold run; the disk tier survives a clean restart, a
`kill -9` at any moment, and damaged files (removed and counted, never served); bad tier flags stop the
server at once with a message naming the flag or path.

Every server compares outputs across cache paths, so all of them run with `EXACT` (f32 weights: one
kernel for every batch size). References come from one server with no tier and no prefix cache.
"""

import os
import random
import re
import signal
import struct
import subprocess
import threading
import time

import openai
import pytest

from conftest import BLOCK, EXACT, KuraServer, kura_bin, model_path

MAX_TOKENS = 8

# Words of one token each (with their leading space) in SmolLM2's vocabulary, give or take a few.
WORDS = (
    "river stone lantern harbor meadow copper willow signal orchard canyon violet engine mirror thunder "
    "saddle pepper glacier velvet anchor summit garden window silver forest candle bridge market castle "
    "planet rocket winter summer autumn spring island desert valley ocean cloud storm light shadow paper "
    "pencil table chair story music dance field train"
).split()


def text(words: int, seed: str) -> str:
    """Deterministic random words: prompts of different seeds share no prefix block."""
    rng = random.Random(f"kura-tiers/{seed}")
    return " ".join(rng.choice(WORDS) for _ in range(words))


def full_blocks_before_last(n: int) -> int:
    """Tokens of a prompt of `n` tokens that a fully cached prefix serves: every full block before the
    last token (the last token is always computed, to get logits)."""
    return (n - 1) // BLOCK * BLOCK


def complete(server: KuraServer, prompt: str, max_tokens: int = MAX_TOKENS, timeout: float = 300):
    return server.client(timeout=timeout).completions.create(
        model=server.model(), prompt=prompt, max_tokens=max_tokens, temperature=0
    )


def tier(m: dict, name: str, which: str) -> float:
    return m[f'kura:{name}{{tier="{which}"}}']


def block_files(disk_dir) -> list:
    root = disk_dir / "blocks"
    return sorted(root.glob("*/*.kvb")) if root.exists() else []


def header_tokens(path) -> tuple:
    """The tokens a block file's header names (layout at the top of crates/kura-tiers/src/disk.rs)."""
    data = path.read_bytes()
    assert data[:8] == b"KURAKVB1", path
    (n,) = struct.unpack_from("<I", data, 80)
    return struct.unpack_from(f"<{n}I", data, 84)


def header_len(path) -> int:
    return struct.unpack_from("<I", path.read_bytes(), 12)[0]


def flip_byte(path, offset: int):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def plain_log(server: KuraServer) -> str:
    """The server's log without its colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", server.log())


def assert_stops_cleanly(server: KuraServer):
    rc = server.stop(signal.SIGTERM, timeout=120)
    assert rc == 0, f"kura serve exited with {rc} after SIGTERM:\n{server.log()[-4000:]}"


class Reference:
    """Cold outputs: one server with no tier and no prefix cache, started on first use."""

    def __init__(self):
        self.server = None
        self.outputs = {}

    def __call__(self, prompt: str) -> str:
        if prompt not in self.outputs:
            if self.server is None:
                self.server = KuraServer("--kv-cache-memory", "128MiB", "--no-prefix-cache", *EXACT)
            r = complete(self.server, prompt)
            assert r.usage.prompt_tokens_details.cached_tokens == 0
            self.outputs[prompt] = r.choices[0].text
        return self.outputs[prompt]

    def stop(self):
        if self.server is not None:
            self.server.stop()


@pytest.fixture(scope="module")
def reference():
    ref = Reference()
    yield ref
    ref.stop()


# Six prompts of 300-450 tokens (19-28 blocks): two fit in a 16MiB pool (45 blocks) at once.
BASE = [text(300 + 30 * i, seed=f"base-{i}") for i in range(6)]


def test_revisits_are_served_from_the_host_and_disk_tiers(tmp_path):
    # Pool: 182 blocks; host tier: 45 blocks; three prompts of ~1,500 tokens: 3 × 94 blocks, so the first
    # prompts' blocks go down to the host tier and from there to disk.
    disk = tmp_path / "kv"
    s = KuraServer("--kv-cache-memory", "64MiB", "--kv-host-memory", "16MiB", "--kv-disk-path", str(disk),
                   *EXACT)
    try:
        prompts = [text(1500, seed=f"revisit-{i}") for i in range(3)]
        cold = []
        for p in prompts:
            r = complete(s, p)
            # No full block in common (a few leading words may be: the pool reuses partial blocks too).
            assert r.usage.prompt_tokens_details.cached_tokens < BLOCK
            assert r.usage.prompt_tokens >= 1400
            cold.append(r)
        before = s.wait_idle()
        assert before["kura:kv_disk_writes_total"] > 0, "the working set overflowed pool and host tier"
        assert tier(before, "kv_tier_blocks_used", "host") > 0
        assert tier(before, "kv_tier_blocks_used", "disk") > 0
        for p, c in zip(prompts, cold):
            r = complete(s, p)
            n = r.usage.prompt_tokens
            assert n == c.usage.prompt_tokens
            assert r.usage.prompt_tokens_details.cached_tokens >= full_blocks_before_last(n), (
                f"revisit of a {n}-token prompt: {r.usage.prompt_tokens_details.cached_tokens} cached")
            assert r.choices[0].text == c.choices[0].text
        m = s.wait_idle()
        hits = {t: tier(m, "kv_tier_hit_blocks_total", t) - tier(before, "kv_tier_hit_blocks_total", t)
                for t in ("host", "disk")}
        print(f"\nrevisits: {hits['host']:.0f} blocks from the host tier, {hits['disk']:.0f} from disk")
        assert hits["host"] > 0 and hits["disk"] > 0, hits
        assert tier(m, "kv_tier_loads_total", "host") > 0
        assert tier(m, "kv_tier_loads_total", "disk") > 0
        assert m["kura:kv_disk_reads_total"] > 0
        assert tier(m, "kv_tier_load_failures_total", "host") == 0
        assert tier(m, "kv_tier_load_failures_total", "disk") == 0
        assert m["kura:kv_tier_checksum_failures_total"] == 0
    finally:
        s.stop()


def test_blocks_stored_ahead_are_evicted_without_a_copy():
    # Pool: 182 blocks; host tier: 364. `--kv-store-ahead 150` keeps the pool's next 150 evictions
    # copied to the host tier ahead of need (what a GPU server does by default, so that no step waits
    # for the copy of a block its own pass evicted), so the third prompt's 94 blocks evict blocks
    # already stored, and revisits load them back with the cold tokens.
    s = KuraServer("--kv-cache-memory", "64MiB", "--kv-host-memory", "128MiB", "--kv-store-ahead", "150",
                   *EXACT)
    try:
        assert "stored in the host tier ahead of need" in plain_log(s), plain_log(s)[-3000:]
        prompts = [text(1500, seed=f"ahead-{i}") for i in range(3)]
        cold = [complete(s, p) for p in prompts]
        for p, c in zip(prompts, cold):
            r = complete(s, p)
            assert r.usage.prompt_tokens_details.cached_tokens >= full_blocks_before_last(r.usage.prompt_tokens)
            assert r.choices[0].text == c.choices[0].text
        m = s.wait_idle()
        assert m["kura:kv_cache_evictions_total"] > 0
        assert tier(m, "kv_tier_hit_blocks_total", "host") > 0
        assert m["kura:kv_host_stored_ahead_blocks_total"] > 0
        assert m["kura:kv_evictions_copied_total"] == 0, (
            f"{m['kura:kv_evictions_copied_total']:.0f} of {m['kura:kv_cache_evictions_total']:.0f} "
            "evictions copied their block")
    finally:
        assert_stops_cleanly(s)


def test_disk_tier_survives_a_clean_restart(tmp_path, reference):
    disk = tmp_path / "kv"
    prompt = text(4000, seed="restart")
    args = ("--kv-cache-memory", "128MiB", "--kv-disk-path", str(disk), *EXACT)
    a = KuraServer(*args)
    try:
        first = complete(a, prompt)
        n = first.usage.prompt_tokens
        assert 3900 <= n <= 4100
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert a.wait_idle()["kura:kv_disk_writes_total"] == 0, "nothing was evicted: the pool holds the prompt"
    finally:
        assert_stops_cleanly(a)
    # The prompt's blocks stayed in the pool (364 blocks): only the clean stop puts them on disk.
    files = block_files(disk)
    assert len(files) >= full_blocks_before_last(n) // BLOCK, f"{len(files)} block files after a clean stop"
    b = KuraServer(*args)
    try:
        second = complete(b, prompt)
        assert second.usage.prompt_tokens == n
        assert second.usage.prompt_tokens_details.cached_tokens >= full_blocks_before_last(n)
        assert second.choices[0].text == first.choices[0].text
        m = b.wait_idle()
        assert tier(m, "kv_tier_hit_blocks_total", "disk") >= full_blocks_before_last(n) // BLOCK
        assert m["kura:kv_disk_reads_total"] >= full_blocks_before_last(n) // BLOCK
        assert m["kura:kv_tier_checksum_failures_total"] == 0
    finally:
        assert_stops_cleanly(b)
    assert first.choices[0].text == reference(prompt)


class Stream:
    """Distinct prompts sent one after another from a thread until the server dies: each is one of BASE
    (found in the tiers) followed by fresh words (new blocks, written to disk)."""

    def __init__(self, server: KuraServer, rng: random.Random, tag: str):
        self.server, self.rng, self.tag = server, rng, tag
        self.started, self.finished, self.errors = [], [], []
        self.model = server.model()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        client = self.server.client(timeout=60)
        for j in range(1000):
            k = self.rng.randrange(len(BASE))
            prompt = BASE[k] + " " + text(self.rng.randint(20, 120), seed=f"{self.tag}-{j}")
            self.started.append(k)
            try:
                client.completions.create(model=self.model, prompt=prompt, max_tokens=4, temperature=0)
            except Exception as e:  # the server is killed under the request
                self.errors.append(e)
                return
            self.finished.append(k)


def test_disk_tier_survives_kill_9(tmp_path, reference):
    refs = [reference(p) for p in BASE]
    disk = tmp_path / "kv"
    loops = int(os.environ.get("KURA_TIERS_KILL_LOOPS", "20"))
    rng = random.Random(20261124)
    configs = [
        ("--kv-offload-policy", "write-back"),
        ("--kv-offload-policy", "write-through", "--kv-offload-min-hits", "0"),
        ("--kv-host-memory", "4MiB", "--kv-offload-policy", "write-through", "--kv-offload-min-hits", "0"),
    ]
    disk_hits = restarts_with_blocks = 0
    previous = None  # (base prompts sent before the last kill, not sent)
    history = []  # per kill: delay / requests finished + cut / disk hits of the checks before it
    for i in range(loops + 1):
        s = KuraServer("--kv-cache-memory", "16MiB", "--kv-disk-path", str(disk), *configs[i % len(configs)],
                       *EXACT)
        try:
            if previous is None:
                checks = [0]
            elif i == loops:
                checks = range(len(BASE))
            else:
                seen, unseen = previous
                checks = [rng.choice(seen)] if seen else []
                checks += [rng.choice(unseen)] if unseen else []
            for k in checks:
                r = complete(s, BASE[k])
                assert r.choices[0].text == refs[k], (
                    f"restart {i}: prompt {k} (cached {r.usage.prompt_tokens_details.cached_tokens} of "
                    f"{r.usage.prompt_tokens}) differs from the cold reference")
            m = s.wait_idle()
            # A kill leaves whole files or none (each block is renamed into place): nothing is damaged.
            opened = [line for line in plain_log(s).splitlines() if "disk KV tier opened" in line]
            assert len(opened) == 1 and "removed_corrupt=0 " in opened[0], opened
            assert m["kura:kv_tier_checksum_failures_total"] == 0, f"restart {i}\n{s.log()[-3000:]}"
            assert tier(m, "kv_tier_load_failures_total", "disk") == 0
            disk_hits += tier(m, "kv_tier_hit_blocks_total", "disk")
            restarts_with_blocks += tier(m, "kv_tier_hit_blocks_total", "disk") > 0
            if i == loops:
                break
            stream = Stream(s, random.Random(rng.random()), tag=f"kill-{i}")
            delay = rng.uniform(0.3, 2.0)
            time.sleep(delay)  # a kill at an arbitrary point of the run: what is tested is any point
            rc = s.stop(signal.SIGKILL)
            assert rc == -signal.SIGKILL
            stream.thread.join(60)
            assert not stream.thread.is_alive()
            # The only error a request may meet is the connection going away with the process.
            assert all(isinstance(e, openai.APIConnectionError) for e in stream.errors), stream.errors
            seen = sorted(set(stream.started))
            history.append(f"{delay:.2f}s/{len(stream.finished)}+{len(stream.started) - len(stream.finished)}"
                           f"/{tier(m, 'kv_tier_hit_blocks_total', 'disk'):.0f}")
            previous = (seen, [k for k in range(len(BASE)) if k not in seen])
        finally:
            s.stop()
    print(f"\n{loops} kills: {restarts_with_blocks} restarts served blocks from disk, {disk_hits:.0f} disk hits; "
          f"per kill (delay/requests done+cut/disk hits): {' '.join(history)}")
    assert restarts_with_blocks > 0
    assert disk_hits > 0


def test_damaged_block_files_are_removed_and_never_served(tmp_path, reference):
    prompts = BASE[:5]
    refs = [reference(p) for p in prompts]
    disk = tmp_path / "kv"
    args = ("--kv-cache-memory", "64MiB", "--kv-disk-path", str(disk), *EXACT)
    a = KuraServer(*args)
    try:
        tokens = [a.tokenize(p) for p in prompts]
        for p in prompts:
            assert complete(a, p).usage.prompt_tokens_details.cached_tokens < BLOCK
    finally:
        assert_stops_cleanly(a)
    by_tokens = {header_tokens(f): f for f in block_files(disk)}

    def file_of(k: int, block: int):
        chunk = tuple(tokens[k][block * BLOCK:(block + 1) * BLOCK])
        assert chunk in by_tokens, f"no block file for block {block} of prompt {k} after a clean stop"
        return by_tokens[chunk]

    # Which block of which prompt is damaged, and how.
    payload_flips = {0: 2, 1: 5}
    header_flip, truncated, garbage = (2, 1), (3, 4), (4, 6)
    for k, b in payload_flips.items():
        f = file_of(k, b)
        flip_byte(f, header_len(f) + 1000)
    f = file_of(*header_flip)
    flip_byte(f, 84 + 4 * 3)  # a token
    open_damaged = [f]
    f = file_of(*truncated)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    open_damaged.append(f)
    f = file_of(*garbage)
    f.write_bytes(random.Random(1).randbytes(f.stat().st_size))
    open_damaged.append(f)
    name = "ab" + "0123456789abcdef0123456789abcd"
    (disk / "blocks" / "ab").mkdir(exist_ok=True)
    stray_block = disk / "blocks" / "ab" / f"{name}.kvb"
    stray_block.write_bytes(random.Random(2).randbytes(5000))
    open_damaged.append(stray_block)
    stray_tmp = disk / "tmp" / "leftover-of-a-crash.tmp"
    stray_tmp.parent.mkdir(exist_ok=True)
    stray_tmp.write_bytes(b"half a block")
    payload_damaged = [file_of(k, b) for k, b in payload_flips.items()]

    b = KuraServer(*args)
    try:
        for f in open_damaged:
            assert not f.exists(), f"{f} damaged, still on disk after the restart"
        assert not stray_tmp.exists()
        for f in payload_damaged:  # found only when read
            assert f.exists()
        damaged_at = {**payload_flips, header_flip[0]: header_flip[1], truncated[0]: truncated[1],
                      garbage[0]: garbage[1]}
        # Prompts whose damaged file was found at open first: no read fails for them.
        accounting = []
        m = b.wait_idle()
        for n, k in enumerate([2, 3, 4, 0, 1]):
            r = complete(b, prompts[k])
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert r.choices[0].text == refs[k], f"prompt {k} (cached {cached}) differs from the cold reference"
            before, m = m, b.wait_idle()
            computed = m["kura:prompt_tokens_computed_total"] - before["kura:prompt_tokens_computed_total"]
            if k in payload_flips:
                # The blocks before the damaged one come from disk; the damaged one is recomputed (and
                # maybe what follows it), so it is no cached token.
                assert damaged_at[k] * BLOCK <= cached, f"prompt {k}: {cached} tokens cached"
                ok = cached <= full_blocks_before_last(r.usage.prompt_tokens) - BLOCK
            else:
                # The chain on disk ends where the file was removed.
                assert cached == damaged_at[k] * BLOCK, f"prompt {k}: {cached} tokens cached"
                ok = True
            accounting.append((k, r.usage.prompt_tokens, cached, computed, ok))
            if n == 0:
                assert m["kura:kv_tier_checksum_failures_total"] == len(open_damaged), b.log()[-3000:]
                assert tier(m, "kv_tier_load_failures_total", "disk") == 0
        assert tier(m, "kv_tier_load_failures_total", "disk") == len(payload_damaged)
        assert m["kura:kv_tier_checksum_failures_total"] == len(open_damaged) + len(payload_damaged)
        for f in payload_damaged:
            assert not f.exists(), f"{f} failed its checksum, still on disk"
    finally:
        assert_stops_cleanly(b)
    # The recomputed blocks went back to disk at the clean stop: a third start serves every prompt.
    c = KuraServer(*args)
    try:
        for k, p in enumerate(prompts):
            r = complete(c, p)
            assert r.choices[0].text == refs[k]
            assert r.usage.prompt_tokens_details.cached_tokens >= full_blocks_before_last(r.usage.prompt_tokens)
        assert c.wait_idle()["kura:kv_tier_checksum_failures_total"] == 0
    finally:
        assert_stops_cleanly(c)
    # Usage must count what was served from a tier, not a block whose load failed and was recomputed.
    wrong = [x for x in accounting if not x[4] or x[2] + x[3] != x[1]]
    assert not wrong, (
        "a block whose disk load failed its checksum was recomputed but still reported in "
        "usage.prompt_tokens_details.cached_tokens (cached + computed > prompt tokens); "
        f"(prompt, prompt_tokens, cached_tokens, tokens computed, damaged block not counted): {wrong}")


def test_metrics_show_the_restored_disk_tier_before_the_first_request(tmp_path):
    """/metrics right after a restart: the blocks found on disk and the damaged files removed at open."""
    disk = tmp_path / "kv"
    args = ("--kv-cache-memory", "16MiB", "--kv-disk-path", str(disk), *EXACT)
    a = KuraServer(*args)
    try:
        complete(a, text(200, seed="metrics-at-start"))
    finally:
        assert_stops_cleanly(a)
    kept = len(block_files(disk))
    assert kept >= 12
    garbage = disk / "blocks" / "cd" / ("cd" + "f" * 30 + ".kvb")
    garbage.parent.mkdir(exist_ok=True)
    garbage.write_bytes(b"not a block" * 100)
    b = KuraServer(*args)
    try:
        assert "removed_corrupt=1 " in plain_log(b) and not garbage.exists()
        deadline = time.time() + 5
        while True:  # no request is sent: the engine has nothing to step
            m = b.metrics()
            shown = (tier(m, "kv_tier_blocks_used", "disk"), m["kura:kv_tier_checksum_failures_total"])
            if shown == (kept, 1) or time.time() > deadline:
                break
            time.sleep(0.2)  # poll interval
        assert shown == (kept, 1), (
            "/metrics must show the disk tier's restored blocks and the damaged files removed at open "
            "before the first request")
    finally:
        assert_stops_cleanly(b)


def start_fails(*args: str, timeout: float = 60) -> tuple[int, str, float]:
    cmd = [kura_bin(), "serve", "--model", model_path(), "--port", "0", "--kv-cache-memory", "16MiB", *args]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


@pytest.mark.parametrize(
    "args, expect",
    [
        (("--kv-disk-path", "{dir}", "--kv-disk-size", "0"), ("--kv-disk-size",)),
        (("--kv-disk-path", "{dir}", "--kv-disk-size", "1KiB"), ("--kv-disk-size 1.00 KiB holds no KV block",)),
        (("--kv-disk-path", ""), ("--kv-disk-path",)),
        (("--preemption-mode", "swap"), ("--preemption-mode swap", "--kv-host-memory")),
        (("--kv-host-memory", "1PB"), ("--kv-host-memory",)),
        (("--kv-host-memory", "1000TB"), ("--kv-host-memory 1000TB", "available")),
        (("--kv-offload-policy", "write-through"), ("--kv-offload-policy write-through",)),
        (("--kv-disk-path", "{file}"), ("{file}",)),
        (("--kv-store-ahead", "64"), ("--kv-store-ahead needs a host tier", "--kv-host-memory")),
        (("--kv-host-memory", "64MiB", "--kv-store-ahead", "lots"), ("--kv-store-ahead",)),
        (("--kv-host-memory", "100KiB", "--preemption-mode", "swap"), ("--kv-host-memory 100.00 KiB holds no KV block",)),
        (("--kv-host-memory", "64MiB", "--no-prefix-cache"), ("--no-prefix-cache", "--kv-host-memory")),
    ],
    ids=["disk-size-0", "disk-size-less-than-a-block", "disk-path-empty", "swap-without-host", "host-1PB", "host-more-than-memory", "write-through-without-tier",
         "disk-path-is-a-file", "store-ahead-without-host", "store-ahead-not-a-number", "host-less-than-a-block",
         "tiers-without-prefix-cache"],
)
def test_bad_tier_flags_stop_the_server(tmp_path, args, expect):
    file = tmp_path / "not-a-dir"
    file.write_text("a regular file")
    fill = dict(dir=str(tmp_path / "kv"), file=str(file))
    rc, out, secs = start_fails(*(a.format(**fill) for a in args))
    assert rc != 0, out
    for e in expect:
        assert e.format(**fill) in out, out
    assert secs < 30, f"took {secs:.1f} s to fail"
    assert "serving the OpenAI API" not in out
    assert file.read_text() == "a regular file"
    assert not (tmp_path / "kv").exists()
