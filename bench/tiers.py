#!/usr/bin/env python3
"""The lower KV tiers measured against recompute, each figure from real `kura serve` processes on the
default model (standard library only; run through bench/tiers.sh, which builds the release binary).

  revisit   TTFT of a prompt revisited after its blocks left the pool, loaded from the host tier (L2) or
            from disk (L3), against the same prompt computed cold, across prompt lengths (64 to 4,096).
  workset   A working set several times the pool: documents of ~2,000 tokens visited, then revisited,
            with a 64 MiB pool and a 1 GiB host tier (then a disk tier): revisit TTFT against cold.
  restart   A 4,000-token prompt, the server stopped and started again on the same --kv-disk-path:
            cached_tokens, TTFT against cold, the same greedy output.
  convoy    16 concurrent requests sharing a 2,000-token prefix that is only on disk: disk reads, and
            every TTFT against one such request alone.
  hostconvoy
            32 concurrent requests sharing a prefix (`--convoy-tokens`, 4,096 by default) that is only in
            the host tier (L2), evicted from the pool by other prompts: host loads (the prefix read once),
            and the worst TTFT against the same 32 requests with the prefix in the pool. With
            `--device cuda` the loads are asynchronous copies beside the other steps.

Every revisit's output is compared with its cold output (greedy): a difference is an error. Medians of
`--reps` runs; the machine's load average is printed with each section.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "river", "stone", "cloud", "light", "north",
         "amber", "cedar", "ember", "frost", "grove", "harbor", "iris", "jade", "kite", "lotus"]


def text(seed, n_words):
    """About 2 tokens per word; distinct seeds share no prefix."""
    return f"Record {seed}: " + " ".join(
        WORDS[(seed * 7 + j * j + j) % len(WORDS)] + str((seed * 31 + j) % 89) for j in range(n_words))


# `--device` of every server (`cpu`, or `cuda[:N]`), set from the command line.
DEVICE = "cpu"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load():
    return os.getloadavg()[0]


class Server:
    def __init__(self, kura, model, threads, *args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="kura-tiers-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [kura, "serve", "--model", model, "--port", str(self.port), "--threads", str(threads),
             "--device", DEVICE, *args],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                break
            except Exception:
                if self.proc.poll() is not None or time.time() > deadline:
                    sys.exit(f"kura serve did not start: {open(self.log.name).read()[-3000:]}")
                time.sleep(0.2)
        models = json.loads(urllib.request.urlopen(self.url + "/v1/models").read())
        self.model = models["data"][0]["id"]

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        if self.proc.wait(timeout=120) != 0:
            sys.exit(f"kura serve exited {self.proc.returncode}: {open(self.log.name).read()[-3000:]}")

    def tokens(self, prompt):
        body = json.dumps({"model": self.model, "prompt": prompt}).encode()
        req = urllib.request.Request(self.url + "/tokenize", body, {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req).read())["count"]

    def ask(self, prompt, max_tokens=8):
        """(TTFT s, output text, prompt tokens, cached tokens), streamed, greedy."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        ttft, out, usage = None, "", None
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("choices"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    out += ev["choices"][0]["text"]
                if ev.get("usage"):
                    usage = ev["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return ttft, out, usage["prompt_tokens"], cached

    def metric(self, name):
        for line in urllib.request.urlopen(self.url + "/metrics").read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        sys.exit(f"metric {name} missing")


def words_for(server, tokens):
    """Words of `text` that make about `tokens` tokens (measured with the server's tokenizer)."""
    per_word = server.tokens(text(0, 200)) / 200
    return max(1, int(tokens / per_word))


def engine_times(server):
    """The engine's forward seconds, the rest of its steps' seconds, and its scheduling passes so far."""
    return (server.metric("kura:engine_forward_seconds_total"),
            server.metric("kura:engine_step_other_seconds_total"),
            server.metric("kura:scheduler_passes_total"))


def med(xs):
    return statistics.median(xs)


def check_same(label, cold, again):
    if cold != again:
        sys.exit(f"{label}: output differs from the cold run: {cold!r} vs {again!r}")


def revisit(a, tmp):
    """TTFT from L2 and from L3 against recompute, across prompt lengths."""
    lengths = [64, 256, 1024, 2048, 4096]
    pool = "100MiB"  # 4,551 tokens: a 4,096-token prompt fits, and 4,700 tokens of others evict it
    rows = []
    for tier, extra in (("L2 host", ["--kv-host-memory", "1GiB", "--preemption-mode", "recompute"]),
                        ("L3 disk", ["--kv-disk-path", os.path.join(tmp, "revisit-disk"), "--kv-disk-size", "4GiB"])):
        s = Server(a.kura, a.model, a.threads, "--kv-cache-memory", pool, *extra)
        fill_words = words_for(s, 2350)
        seed = 1000
        for n in lengths:
            words = words_for(s, n)
            cold, hot = [], []
            for rep in range(a.reps):
                seed += 1
                p = text(seed, words)
                t_cold, out_cold, ptoks, _ = s.ask(p)
                # Push it out of the pool: two unrelated prompts of ~2,350 tokens.
                for k in range(2):
                    seed += 1
                    s.ask(text(seed, fill_words), max_tokens=1)
                t_hot, out_hot, _, cached = s.ask(p)
                check_same(f"{tier} {n}", out_cold, out_hot)
                if cached < (ptoks - 1) // 16 * 16:
                    sys.exit(f"{tier} {n}: cached {cached} of {ptoks}: the revisit was not served from the tier")
                cold.append(t_cold)
                hot.append(t_hot)
            rows.append((tier, ptoks, med(cold) * 1e3, med(hot) * 1e3))
            print(f"  {tier} {ptoks:5d} tokens: cold {med(cold)*1e3:8.1f} ms, revisit {med(hot)*1e3:7.1f} ms, "
                  f"{med(cold)/med(hot):6.1f}x  (load {load():.1f})", flush=True)
        s.stop()
    return rows


def workset(a, tmp):
    """Documents of ~2,000 tokens, a working set several times the 64 MiB pool, visited then revisited."""
    out = []
    for tier, extra in (("L2 host", ["--kv-host-memory", "1GiB", "--preemption-mode", "recompute"]),
                        ("L3 disk", ["--kv-disk-path", os.path.join(tmp, "workset-disk"), "--kv-disk-size", "4GiB"])):
        s = Server(a.kura, a.model, a.threads, "--kv-cache-memory", "64MiB", *extra)
        words = words_for(s, 2000)
        docs = [text(5000 + i, words) for i in range(a.docs)]
        cold, hot, first, toks = [], [], {}, 0
        for i, d in enumerate(docs):
            t, o, ptoks, _ = s.ask(d)
            cold.append(t)
            first[i] = o
            toks += ptoks
        for rnd in range(a.reps):
            for i, d in enumerate(docs):
                t, o, ptoks, cached = s.ask(d)
                check_same(f"{tier} doc {i}", first[i], o)
                hot.append(t)
        hits = s.metric(f'kura:kv_tier_hit_blocks_total{{tier="{tier[3:]}"}}')
        print(f"  {tier}: {a.docs} documents, {toks} tokens (pool 2,912): cold {med(cold)*1e3:.1f} ms, "
              f"revisit {med(hot)*1e3:.1f} ms, {med(cold)/med(hot):.1f}x; {hits:.0f} blocks loaded from the tier "
              f"(load {load():.1f})", flush=True)
        out.append((tier, toks, med(cold) * 1e3, med(hot) * 1e3))
        s.stop()
    return out


def restart(a, tmp):
    disk = os.path.join(tmp, "restart-disk")
    args = ["--kv-cache-memory", "256MiB", "--kv-disk-path", disk, "--kv-disk-size", "2GiB"]
    ref = Server(a.kura, a.model, a.threads, "--kv-cache-memory", "256MiB")
    words = words_for(ref, 4000)
    colds, outs = [], []
    prompts = [text(9000 + r, words) for r in range(a.reps)]
    for p in prompts:
        t, o, ptoks, _ = ref.ask(p)
        colds.append(t)
        outs.append(o)
    ref.stop()
    s = Server(a.kura, a.model, a.threads, *args)
    for p in prompts:
        s.ask(p)
    s.stop()
    s = Server(a.kura, a.model, a.threads, *args)
    hots, cached_all = [], []
    for p, o in zip(prompts, outs):
        t, o2, ptoks, cached = s.ask(p)
        check_same("restart", o, o2)
        hots.append(t)
        cached_all.append((cached, ptoks))
    s.stop()
    print(f"  restart: cached after restart / prompt tokens {[f'{c}/{p}' for c, p in cached_all]}, "
          f"cold {med(colds)*1e3:.1f} ms, after restart {med(hots)*1e3:.1f} ms, {med(colds)/med(hots):.1f}x, same output "
          f"(load {load():.1f})", flush=True)
    return cached_all[0], med(colds) * 1e3, med(hots) * 1e3


def block_prefix(server, seed, tokens):
    """A prompt of about `tokens` tokens cut to a whole number of 16-token blocks, and its token count."""
    words = text(seed, words_for(server, tokens)).split(" ")
    while server.tokens(" ".join(words)) % 16:
        words.pop()
    prefix = " ".join(words)
    return prefix, server.tokens(prefix)


def prefix_as_long(server, seed, tokens, want):
    """`block_prefix` of the first of up to 64 seeds from `seed` on whose token count is `want` (else the
    nearest): a second prefix as long as a first."""
    best = None
    for j in range(64):
        prefix, count = block_prefix(server, seed + 1000 * j, tokens)
        if best is None or abs(count - want) < abs(best[1] - want):
            best = (prefix, count)
        if count == want:
            break
    return best


def convoy_suffix(k):
    """A suffix whose first token is a word of its own (lower or capitalized): no partial-block reuse."""
    w = WORDS[k % len(WORDS)]
    return f" {w if k < len(WORDS) else w.capitalize()} question {k}?"


def at_once(server, prompts, max_tokens=4):
    """`server.ask` of every prompt, all at once (a thread each): the results in order."""
    out = [None] * len(prompts)

    def one(k):
        out[k] = server.ask(prompts[k], max_tokens=max_tokens)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompts))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def convoy(a, tmp):
    """16 requests over one prefix only on disk, against one alone and against 16 over the prefix in the pool.

    The prefix ends on a block boundary and each suffix starts with a token of its own, so every request
    computes only its suffix, from disk or from the pool alike (no partial-block reuse between them)."""
    disk = os.path.join(tmp, "convoy-disk")
    args = ["--kv-cache-memory", "256MiB", "--kv-disk-path", disk, "--kv-disk-size", "2GiB", "--max-num-seqs", "32"]
    s = Server(a.kura, a.model, a.threads, *args)
    prefix, _ = block_prefix(s, 7777, 2000)
    s.ask(prefix + convoy_suffix(39), max_tokens=1)
    s.stop()
    singles, results = [], []
    for rep in range(a.reps):
        # Alone: the prefix only on disk (a restart empties the pool; a clean stop wrote it down).
        s = Server(a.kura, a.model, a.threads, *args)
        t, _, ptoks, cached = s.ask(prefix + convoy_suffix(32 + rep), max_tokens=4)
        singles.append(t)
        s.stop()
        s = Server(a.kura, a.model, a.threads, *args)
        reads0 = s.metric("kura:kv_disk_reads_total")

        def wave(first):
            return [r[0] for r in at_once(s, [prefix + convoy_suffix(first + k) for k in range(16)])]

        from_disk = wave(0)
        reads = s.metric("kura:kv_disk_reads_total") - reads0
        # 16 others, the prefix now in the pool: the same work without any load.
        from_pool = wave(16)
        s.stop()
        results.append((reads, max(from_disk), max(from_pool)))
        print(f"  convoy run {rep}: prefix {cached} cached tokens of {ptoks}; alone {t*1e3:.1f} ms; 16 at once "
              f"from disk: {reads:.0f} block reads, TTFT median {med(from_disk)*1e3:.1f} ms, max "
              f"{max(from_disk)*1e3:.1f} ms; 16 at once from the pool: median {med(from_pool)*1e3:.1f} ms, max "
              f"{max(from_pool)*1e3:.1f} ms (load {load():.1f})", flush=True)
    single = med(singles)
    worst = med([r[1] for r in results])
    worst_pool = med([r[2] for r in results])
    print(f"  convoy: alone {single*1e3:.1f} ms, worst of 16 from disk {worst*1e3:.1f} ms ({worst/single:.2f}x alone, "
          f"{worst/worst_pool:.2f}x the same 16 from the pool: {worst_pool*1e3:.1f} ms); block reads per run "
          f"{[int(r[0]) for r in results]}", flush=True)
    return single * 1e3, worst * 1e3, worst_pool * 1e3, [int(r[0]) for r in results]


def hostconvoy(a, tmp):
    """32 requests over one prefix only in the host tier, against the same 32 suffixes over another prefix
    as long, in the pool.

    Both follow a warm-up convoy of 32 over a third prefix, so that neither pays for the first steps of
    their shape. The prefixes end on a block boundary, so every request computes only its suffix. Other
    prompts as long as the prefix, sent after it until they alone would fill the pool, evict it into the
    host tier. The convoy from the pool has the host tier's suffixes over a prefix of its own (asked once
    just before, so in the pool), not other suffixes over the same prefix: the same work, and no block of
    the first convoy to reuse (other suffixes share words, and a tokenizer's first tokens of them, with
    the first convoy's; before, the second convoy reused those and computed fewer tokens)."""
    n = a.convoy_tokens
    args = ["--kv-cache-memory", a.convoy_pool, "--kv-host-memory", "4GiB", "--max-num-seqs", "64"]
    results = []
    for rep in range(a.reps):
        s = Server(a.kura, a.model, a.threads, *args)
        # A warm-up convoy first, over a prefix of its own in the pool: the step shapes of 32 sequences
        # (buffers sized, on a GPU the kernels' first launches) cost once, before either measured convoy.
        warm, _ = block_prefix(s, 7000 + rep, n)
        s.ask(warm + convoy_suffix(63), max_tokens=1)
        at_once(s, [warm + convoy_suffix(k) for k in range(32)])
        prefix, prefix_tokens = block_prefix(s, 8888 + rep, n)
        s.ask(prefix + convoy_suffix(63), max_tokens=1)
        # Prompts as long as the prefix, sent after it (the pool evicts the oldest first), until they alone
        # would fill the pool.
        pool_blocks = s.metric("kura:kv_cache_blocks_total")
        n_words = len(prefix.split(" "))
        for other in range(int(pool_blocks // max(1, prefix_tokens // 16)) + 1):
            s.ask(text(9900 + 100 * rep + other, n_words), max_tokens=1)
        loads0 = s.metric('kura:kv_tier_loads_total{tier="host"}')
        engine0 = engine_times(s)
        from_host = at_once(s, [prefix + convoy_suffix(k) for k in range(32)])
        engine1 = engine_times(s)
        loads = s.metric('kura:kv_tier_loads_total{tier="host"}') - loads0
        # The same suffixes over another prefix as long (asked once just before: in the pool).
        prefix2, prefix2_tokens = prefix_as_long(s, 8800 + rep, n, prefix_tokens)
        s.ask(prefix2 + convoy_suffix(63), max_tokens=1)
        engine1b = engine_times(s)
        from_pool = at_once(s, [prefix2 + convoy_suffix(k) for k in range(32)])
        engine2 = engine_times(s)
        s.stop()
        # Where each convoy's time went in the engine: its forward passes, the rest of its steps (the
        # scheduler, tier moves, output), and how many passes (the time outside the steps is HTTP,
        # tokenization and waiting).
        for what, a0, a1 in (("host tier", engine0, engine1), ("pool", engine1b, engine2)):
            print(f"  host convoy run {rep}, from the {what}: engine forward {(a1[0] - a0[0]) * 1e3:.1f} ms, "
                  f"rest of the steps {(a1[1] - a0[1]) * 1e3:.1f} ms, {a1[2] - a0[2]:.0f} passes", flush=True)
        cached = min(r[3] for r in from_host)
        worst_host, worst_pool = max(r[0] for r in from_host), max(r[0] for r in from_pool)
        results.append((loads, cached, worst_host, worst_pool, prefix_tokens // 16))
        # Prompt tokens each convoy computed (the same suffixes: the same, but for the prefixes' lengths).
        computed = [sum(r[2] - r[3] for r in rs) for rs in (from_host, from_pool)]
        print(f"  host convoy run {rep} ({DEVICE}): prefixes of {prefix_tokens} and {prefix2_tokens} tokens; "
              f"the 32 from the host tier: {loads:.0f} block loads, fewest cached {cached}, {computed[0]} prompt "
              f"tokens computed, TTFT median {med([r[0] for r in from_host])*1e3:.1f} ms, max "
              f"{worst_host*1e3:.1f} ms; the 32 from the pool: {computed[1]} computed, median "
              f"{med([r[0] for r in from_pool])*1e3:.1f} ms, max {worst_pool*1e3:.1f} ms (load {load():.1f})",
              flush=True)
    worst = med([r[2] for r in results])
    worst_pool = med([r[3] for r in results])
    print(f"  host convoy: worst of 32 from the host tier {worst*1e3:.1f} ms, {worst/worst_pool:.2f}x the same 32 "
          f"from the pool ({worst_pool*1e3:.1f} ms; goal 1.5x); block loads per run {[int(r[0]) for r in results]} "
          f"for prefixes of {[r[4] for r in results]} blocks", flush=True)
    return worst * 1e3, worst_pool * 1e3, [int(r[0]) for r in results], [r[1] for r in results]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kura", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--only", default="revisit,workset,restart,convoy")
    ap.add_argument("--device", default="cpu", help="every server's --device: cpu, or cuda[:N]")
    ap.add_argument("--convoy-tokens", type=int, default=4096, help="hostconvoy's shared prefix, in tokens")
    ap.add_argument("--convoy-pool", default="160MiB",
                    help="hostconvoy's pool: room for about two prompts of --convoy-tokens")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    tmp = tempfile.mkdtemp(prefix="kura-tiers-bench-")
    results = {"threads": a.threads, "reps": a.reps}
    try:
        for name in a.only.split(","):
            print(f"{name} (threads {a.threads}, load {load():.1f})", flush=True)
            results[name] = globals()[name](a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
