"""`kura serve --device cuda` through the official openai client, against `kura serve --device cpu` on the
same model: a long prompt sent twice (completions, then chat) is cold the first time and served from
cached blocks the second, with exactly the `cached_tokens` the CPU server reports for the same requests
(both run the same engine and KV manager), at least the prompt's whole blocks but the last token's, and
the same greedy text cold and cached; the prompt scored (`echo` with `logprobs`) twice gives the same
scores, none from the cache, close to the CPU's. The GPU server sizes its pool as a share of the device
(`--kv-cache-memory 50%`); its log's block count must equal what `kura plan --gpu H100 --memory <the
driver's total, from the same log>` prints for the same model and flags. Then a GPU server with a small
pool and a host tier (`--kv-host-memory`): prompts revisited after the pool evicted them come back from
the host tier (copied asynchronously, beside other steps) with the cold text and every full block cached.
Then `kura generate --device cuda` on the completion's prompt: the GPU server's prompt tokens and text, at
blocks of 16 and of 1 token (the kernels read keys in the same order whatever the block size). Then a
GPU server that drafts (`--speculative-config`) writes the same greedy text as one that does not. Last,
a GPU server that times its kernels as it starts (`KURA_GPU_KERNELS` as the caller has it: unset, every
prefill form and decode option is timed) names the forms it timed and chose, none with other bits, and
answers the completion with the other servers' text. The servers and commands before it run the default
kernels, untimed (`KURA_GPU_KERNELS=default` unless the caller set it): a fault in a kernel form fails that
check alone. Each request has KURA_GPU_REQUEST_TIMEOUT_S (60) to answer, without retries; a check that
raises is a failure, and the checks after it still run.
Usage: serve_check.py KURA MODEL [DEVICE] (DEVICE cuda by default; cpu runs the host-tier check alone, on
the CPU). Exits non-zero on any failure."""

import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai

BLOCK = 16
# Seconds a request may take (the openai client's default is 600, with 2 retries).
REQUEST_TIMEOUT_S = float(os.environ.get("KURA_GPU_REQUEST_TIMEOUT_S", "60"))
# The GPU server's pool: a share of what the weights, CUDA context, activation buffers and reserve leave,
# so that its block count depends on every term of the plan.
GPU_KV = "50%"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_text(rng: random.Random, words: int) -> str:
    """`words` words of the KV cache's vocabulary, drawn by `rng`."""
    return " ".join(rng.choice(["cache", "block", "token", "device", "memory", "prefix", "reuse", "tenant", "layer",
                                "kernel"]) for _ in range(words))


def kernels_env(tune: bool = False) -> dict:
    """The environment of a GPU command: with the default kernels, untimed, unless `tune` or the caller
    set `KURA_GPU_KERNELS`."""
    env = dict(os.environ)
    if not tune:
        env.setdefault("KURA_GPU_KERNELS", "default")
    return env


def client_of(url: str) -> openai.OpenAI:
    """The openai client of the server at `url`: each request within REQUEST_TIMEOUT_S, not retried."""
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def start(kura: str, model: str, device: str, *flags: str, tune: bool = False):
    """`kura serve` on `device` with `flags`, healthy: (process, url, log file). On a GPU the server runs
    the default kernels unless `tune` (`kernels_env`)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [kura, "serve", "--device", device, "--model", model, "--port", str(port), "--block-size", str(BLOCK),
         *flags],
        stdout=log, stderr=subprocess.STDOUT, env=kernels_env(tune))
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        if proc.poll() is not None or time.time() - t0 > 120:
            log.seek(0)
            print(log.read()[-4000:])
            stop(proc)
            raise RuntimeError(f"kura serve --device {device} {' '.join(flags)} did not become healthy")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    print(f"kura serve --device {device} {' '.join(flags)} healthy in {time.time() - t0:.1f} s")
    return proc, url, log


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def run(kura: str, model: str, device: str, words: int = 700) -> tuple[dict, str]:
    """Each request kind's (cold usage, warm usage, cold text, warm text, cold s, warm s) on `device` for a
    prompt of `words` words, and the server's log."""
    kv = GPU_KV if device == "cuda" else "2GiB"
    proc, url, log = start(kura, model, device, "--kv-cache-memory", kv)
    try:
        client = client_of(url)
        name = client.models.list().data[0].id
        prompt = prompt_text(random.Random(5), words)
        out = {}
        for kind in ["completions", "chat"]:
            def ask():
                t = time.perf_counter()
                if kind == "completions":
                    r = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0)
                    text = r.choices[0].text
                else:
                    r = client.chat.completions.create(
                        model=name, max_tokens=16, temperature=0,
                        messages=[{"role": "system", "content": prompt}, {"role": "user", "content": "Summarise."}])
                    text = r.choices[0].message.content
                return r.usage, text, time.perf_counter() - t
            cold, cold_text, cold_s = ask()
            warm, warm_text, warm_s = ask()
            out[kind] = (cold, warm, cold_text, warm_text, cold_s, warm_s)
        # The prompt scored (`echo` with `logprobs`): every position's logits, from the executor's
        # `forward_every_position`; nothing cached is read, though the prompt is cached by now.
        scored = [client.completions.create(model=name, prompt=prompt, max_tokens=0, temperature=0, echo=True,
                                            logprobs=1) for _ in range(2)]
        out["echo"] = [(r.usage, r.choices[0].logprobs.token_logprobs) for r in scored]
        log.seek(0)
        return out, log.read()
    finally:
        stop(proc)


def pool_bytes(model: str, blocks: int) -> str:
    """The bytes of `blocks` blocks of bf16 KV of the model at `model` (its config.json)."""
    c = json.load(open(f"{model}/config.json"))
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return str(blocks * BLOCK * 2 * c["num_hidden_layers"] * kv_heads * head_dim * 2)


def check_host_tier(kura: str, model: str, device: str, pool: str | None = None, words: int = 600) -> list[str]:
    """Four prompts of `words` words (~40 blocks in SmolLM2's tokenizer) through a pool of `pool` (by default
    136 blocks of bf16 KV of the model: 48 MiB in SmolLM2's shape) with a host tier: each revisit is served
    from the pool or the host tier, with the cold text."""
    pool = pool or (pool_bytes(model, 136) if os.path.isfile(f"{model}/config.json") else "48MiB")
    try:
        proc, url, _ = start(kura, model, device, "--kv-cache-memory", pool, "--kv-host-memory", "512MiB")
    except RuntimeError as e:
        return [str(e)]
    failures = []
    try:
        client = client_of(url)
        name = client.models.list().data[0].id
        prompts = [prompt_text(random.Random(100 + i), words) for i in range(4)]
        ask = lambda p: client.completions.create(model=name, prompt=p, max_tokens=16, temperature=0)
        cold = [ask(p) for p in prompts]
        for i, (p, c) in enumerate(zip(prompts, cold)):
            r = ask(p)
            n = r.usage.prompt_tokens
            cached = r.usage.prompt_tokens_details.cached_tokens
            print(f"host tier, prompt {i}: {n} tokens, cold cached {c.usage.prompt_tokens_details.cached_tokens}, "
                  f"revisit cached {cached}; the same text: {r.choices[0].text == c.choices[0].text}")
            if cached < (n - 1) // BLOCK * BLOCK:
                failures.append(f"host tier, prompt {i}: {cached} of {n} tokens cached on the revisit")
            if r.choices[0].text != c.choices[0].text:
                failures.append(f"host tier, prompt {i}: the revisit's text differs from the cold one")
        metrics = httpx.get(url + "/metrics", timeout=10).text
        def metric(name: str) -> float:
            m = re.search(r"^" + re.escape(name) + r" ([0-9.e+-]+)$", metrics, re.M)
            return float(m.group(1)) if m else -1.0
        hits = metric('kura:kv_tier_hit_blocks_total{tier="host"}')
        fails = metric('kura:kv_tier_load_failures_total{tier="host"}')
        print(f"host tier: {hits:.0f} blocks loaded, {fails:.0f} load failures")
        if hits <= 0:
            failures.append(f"host tier: no block came back from it ({hits})")
        if fails != 0:
            failures.append(f"host tier: {fails} load failures")
        ahead = metric("kura:kv_host_stored_ahead_blocks_total")
        copied = metric("kura:kv_evictions_copied_total")
        evictions = metric("kura:kv_cache_evictions_total")
        print(f"host tier: {ahead:.0f} blocks stored ahead; {copied:.0f} of {evictions:.0f} evictions copied their block")
        if device == "cuda" and (ahead <= 0 or copied != 0):
            # The pinned host tier's stores run beside the steps: by default the pool's next evictions
            # are stored ahead, and one prompt at a time never evicts a block not stored yet.
            failures.append(f"host tier: {ahead:.0f} blocks stored ahead, {copied:.0f} evictions copied their block")
    finally:
        stop(proc)
    return failures


def check_plan(kura: str, model: str, log: str, *flags: str) -> list[str]:
    """The GPU server's pool against `kura plan --gpu` with the device's total memory and the same flags
    (`flags`: the server's beyond the pool's)."""
    for line in log.splitlines():
        if "planned | measured" in line:
            print("server:", line.split("INFO", 1)[-1].strip())
    total = re.search(r"GPU memory of .*?: (\d+) bytes in all", log)
    served = re.search(r"KV cache: (\d+) blocks of", log)
    if not total or not served:
        return ["the GPU server's log has no device total or no pool line"]
    out = subprocess.run(
        [kura, "plan", "--model", model, "--gpu", "H100", "--memory", total.group(1), "--kv-cache-memory",
         GPU_KV, "--block-size", str(BLOCK), "--kv-dtype", "bf16", "--json", *flags],
        capture_output=True, text=True)
    if out.returncode != 0:
        return [f"kura plan failed: {out.stderr.strip()}"]
    plan = json.loads(out.stdout)
    planned, served_blocks = plan["num_blocks"], int(served.group(1))
    cuda = plan.get("cuda", {})
    print(f"pool: kura plan --gpu (device total {total.group(1)} bytes) {planned} blocks, kura serve --device cuda "
          f"{served_blocks} blocks; planned weights {cuda.get('weights_bytes')} B, context {cuda.get('context_bytes')} B, "
          f"activations {cuda.get('activation_bytes')} B")
    if planned != served_blocks or cuda.get("num_blocks") != served_blocks:
        return [f"the pool: kura plan {' '.join(flags)} says {planned} blocks, kura serve --device cuda holds "
                f"{served_blocks}"]
    return []


FORMS = ["narrow", "wide", "half", "small", "deep", "halfdeep", "wg", "halfwg", "wgpipe", "halfwgpipe"]


def check_prefill_kernel(log: str) -> list[str]:
    """The GPU server named its prefill attention kernel once: a form, and where it timed them
    (`KURA_GPU_KERNELS` unset), one whose output was the 8-warp kernel's bit for bit, as the decode options
    it timed (the next line) were the default's."""
    lines = [l.split("prefill attention: ", 1)[1] for l in log.splitlines() if "prefill attention: " in l]
    if len(lines) != 1:
        return [f"the GPU server's log names its prefill attention kernel {len(lines)} times, not once"]
    print("server: prefill attention:", lines[0])
    chosen = lines[0].split(" ", 1)[0].rstrip(",")
    if chosen not in FORMS:
        return [f"the GPU server's prefill attention kernel {chosen!r} is not one of {FORMS}"]
    if "KURA_GPU_KERNELS)" in lines[0] or "KURA_GPU_KERNELS=" in lines[0] or "too few tokens" in lines[0]:
        return []
    timed = re.findall(r"(?:: |, )(\w+) [\d.]+ ms( \(other bits\))?", lines[0])
    names = [t[0] for t in timed]
    if len(names) != len(set(names)) or "narrow" not in names:
        return [f"the timed forms are not each form once with narrow among them: {lines[0]}"]
    if (chosen, " (other bits)") in timed:
        return [f"the GPU server chose {chosen}, whose output was not the 8-warp kernel's: {lines[0]}"]
    decode = [l.split(" decode: ", 1)[1] for l in log.splitlines() if " decode: " in l]
    if len(decode) != 1:
        return [f"the GPU server's log names its decode options {len(decode)} times, not once"]
    print("server: decode:", decode[0])
    if "other bits" in decode[0]:
        return [f"a decode option changed the bits: {decode[0]}"]
    return []


def check_generate(kura: str, model: str, gpu: dict, words: int = 700) -> list[str]:
    """`kura generate --device cuda` on the prompt of `run`'s completions: the GPU server's prompt tokens and
    greedy text (both stop at the model's end-of-sequence tokens), at blocks of 16 and of 1 token."""
    usage, _, text, _, _, _ = gpu["completions"]
    prompt = prompt_text(random.Random(5), words)
    failures = []
    for block in [BLOCK, 1]:
        try:
            out = subprocess.run(
                [kura, "generate", "--device", "cuda", "--model", model, "--prompt", prompt, "--max-tokens", "16",
                 "--block-size", str(block), "--json"],
                capture_output=True, text=True, timeout=300, env=kernels_env())
            report = json.loads(out.stdout) if out.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError) as e:
            failures.append(f"kura generate --device cuda --block-size {block}: {e}")
            continue
        if report is None:
            failures.append(f"kura generate --device cuda --block-size {block} failed: {out.stderr.strip()[-2000:]}")
            continue
        same = report["prompt_tokens"] == usage.prompt_tokens and report["text"] == text
        # A figure serde could not write as a number (not finite) comes as null.
        ttft, rate = (report.get(k) for k in ("ttft_ms", "decode_tok_per_s"))
        ttft = "-" if ttft is None else f"{ttft:.1f}"
        rate = "-" if rate is None else f"{rate:.1f}"
        print(f"kura generate --device cuda --block-size {block}: {report['prompt_tokens']} prompt tokens, "
              f"{report['generated_tokens']} generated, TTFT {ttft} ms, decode "
              f"{rate} tok/s; the GPU server's prompt and text: {same}")
        if not same:
            failures.append(f"kura generate --device cuda --block-size {block}: {report['prompt_tokens']} prompt "
                            f"tokens and {report['text']!r}; the GPU server: {usage.prompt_tokens} and {text!r}")
    return failures


def compare(gpu: dict, cpu: dict) -> list[str]:
    """The GPU server's answers (`run` on cuda) against the CPU server's (`run` on cpu): the same prompt
    tokens and `cached_tokens`, cold 0 and warm every whole block but the last token's, and the same text
    cold and cached."""
    failures = []
    for kind in ["completions", "chat"]:
        (cold, warm, cold_text, warm_text, cold_s, warm_s) = gpu[kind]
        cpu_cold, cpu_warm, cpu_text, _, _, _ = cpu[kind]
        n = cold.prompt_tokens
        got = (cold.prompt_tokens_details.cached_tokens, warm.prompt_tokens_details.cached_tokens)
        want = (cpu_cold.prompt_tokens_details.cached_tokens, cpu_warm.prompt_tokens_details.cached_tokens)
        print(f"{kind}: {n} prompt tokens; cached_tokens on the GPU cold {got[0]}, warm {got[1]}; on the CPU "
              f"{want[0]}, {want[1]}; GPU cold {cold_s * 1e3:.0f} ms, warm {warm_s * 1e3:.0f} ms; the same text "
              f"cold and cached: {cold_text == warm_text}; the same text as the CPU: {cold_text == cpu_text}")
        if n != cpu_cold.prompt_tokens:
            failures.append(f"{kind}: {n} prompt tokens on the GPU, {cpu_cold.prompt_tokens} on the CPU")
        if got != want or got[0] != 0 or got[1] < (n - 1) // BLOCK * BLOCK:
            failures.append(f"{kind}: cached_tokens {got} on the GPU, {want} on the CPU")
        if cold_text != warm_text:
            failures.append(f"{kind}: the cached answer differs: {cold_text!r} vs {warm_text!r}")
    failures += compare_echo(gpu["echo"], cpu["echo"])
    return failures


def compare_echo(gpu: list, cpu: list) -> list[str]:
    """A prompt scored twice on the GPU (`echo`, `logprobs` 1, `max_tokens` 0) against the CPU's: a score
    for every prompt token (the first `null`), nothing cached either time, the same scores both times, and
    close to the CPU's (a mean difference under 0.1: scores read one position off would differ by nats)."""
    failures = []
    (usage, scores), (_, again) = gpu
    cpu_scores = cpu[0][1]
    n = usage.prompt_tokens
    cached = [u.prompt_tokens_details.cached_tokens for u, _ in gpu]
    diff = [abs(a - b) for a, b in zip(scores[1:], cpu_scores[1:]) if a is not None and b is not None]
    mean = sum(diff) / max(len(diff), 1)
    print(f"echo: {len(scores)} scores for {n} prompt tokens; cached_tokens {cached}; the same scores twice: "
          f"{scores == again}; mean difference from the CPU's {mean:.4f}")
    if len(scores) != n or scores[0] is not None or len(cpu_scores) != n:
        failures.append(f"echo: {len(scores)} scores on the GPU, {len(cpu_scores)} on the CPU, for {n} tokens")
    if cached != [0, 0]:
        failures.append(f"echo: a scored prompt read {cached} cached tokens")
    if scores != again:
        failures.append("echo: the same prompt scored twice gave different scores")
    if len(diff) != n - 1 or mean >= 0.1:
        failures.append(f"echo: scores differ from the CPU's by {mean:.4f} on average")
    return failures


def check_speculative(kura: str, model: str, device: str, words: int = 120) -> list[str]:
    """A server that drafts (`--speculative-config`, n-gram lookup) against one that does not, on the same
    device: a completion that goes on copying the text it was given, greedy, the same text from both, with
    drafts checked (the CUDA executor checks them in one step with the other sequences, its output head
    on each draft position). On a GPU the drafting server's pool is `kura plan --speculative-config`'s:
    its logits buffers hold a row per draft token; and a third server, whose drafting pauses at 8 decoding
    sequences (`disable_by_batch_size`: rows for 7 sequences' drafts), plans as `kura plan` does too and
    gives the same text (its one request drafts)."""
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    spec = json.dumps(config)
    modes = [("plain", []), ("drafting", ["--speculative-config", spec])]
    if device == "cuda":
        modes.append(("paused at 8", ["--speculative-config", json.dumps(config | {"disable_by_batch_size": 8})]))
    text = prompt_text(random.Random(300), words)
    prompt = "Notes:\n" + text + "\n\nThe same notes again:\n" + text[:40]
    out, failures = {}, []
    for mode, flags in modes:
        kv = GPU_KV if device == "cuda" else "256MiB"
        try:
            proc, url, log = start(kura, model, device, "--kv-cache-memory", kv, *flags)
        except RuntimeError as e:
            return failures + [str(e)]
        try:
            client = client_of(url)
            name = client.models.list().data[0].id
            r = client.completions.create(model=name, prompt=prompt, max_tokens=48, temperature=0,
                                          extra_body={"ignore_eos": True})
            metrics = httpx.get(url + "/metrics", timeout=10).text
            counts = [float(re.search(r"^kura:spec_decode_num_" + what + r"_total ([0-9.e+-]+)$", metrics,
                                      re.M).group(1)) for what in ("draft_tokens", "accepted_tokens")]
            out[mode] = (r.choices[0].text, counts)
            if device == "cuda" and flags:
                log.seek(0)
                failures += check_plan(kura, model, log.read(), *flags)
        finally:
            stop(proc)
    (drafted, kept) = out["drafting"][1]
    print(f"speculative decoding: {drafted:.0f} draft tokens checked, {kept:.0f} kept; "
          f"the same text: {out['plain'][0] == out['drafting'][0]}")
    for mode, (text, (checked, _)) in out.items():
        if text != out["plain"][0]:
            failures.append(f"speculative decoding, {mode}: the text {text!r}, without drafts {out['plain'][0]!r}")
        if mode != "plain" and checked <= 0:
            failures.append(f"speculative decoding, {mode}: no draft was checked")
    return failures


def check_tuning(kura: str, model: str, gpu: dict, words: int = 700) -> list[str]:
    """A GPU server that times its kernels as it starts (`start(..., tune=True)`): its log names the forms
    it timed and chose, none with other bits (`check_prefill_kernel`), and it answers `run`'s completion
    with the same prompt tokens and greedy text as the server of the default kernels (`gpu`)."""
    usage, _, text, _, _, _ = gpu["completions"]
    try:
        proc, url, log = start(kura, model, "cuda", "--kv-cache-memory", GPU_KV, tune=True)
    except RuntimeError as e:
        return [f"the kernel-timing server: {e}"]
    try:
        c = client_of(url)
        r = c.completions.create(model=c.models.list().data[0].id, prompt=prompt_text(random.Random(5), words),
                                 max_tokens=16, temperature=0)
        log.seek(0)
        failures = check_prefill_kernel(log.read())
    finally:
        stop(proc)
    same = r.usage.prompt_tokens == usage.prompt_tokens and r.choices[0].text == text
    print(f"the kernel-timing server: {r.usage.prompt_tokens} prompt tokens; the default kernels' text: {same}")
    if not same:
        failures.append(f"the kernel-timing server: {r.usage.prompt_tokens} prompt tokens and "
                        f"{r.choices[0].text!r}; with the default kernels {usage.prompt_tokens} and {text!r}")
    return failures


def guarded(name: str, check, *args, **kwargs) -> list[str]:
    """`check(*args, **kwargs)`'s failures, or the exception it raised as one."""
    try:
        return check(*args, **kwargs)
    except Exception as e:  # a server that does not answer, a request past its time: this check fails
        return [f"{name}: {type(e).__name__}: {e}"]


def main() -> int:
    args = sys.argv[1:]
    if len(args) not in (2, 3) or args[0] in ("-h", "--help") or args[2:] not in ([], ["cuda"], ["cpu"]):
        print(__doc__, file=sys.stderr)
        return 2
    kura, model = args[0], args[1]
    device = args[2] if len(args) > 2 else "cuda"
    if device != "cuda":
        failures = check_host_tier(kura, model, device)
        for f in failures:
            print("FAIL:", f)
        return 1 if failures else 0
    failures = []
    try:
        gpu, gpu_log = run(kura, model, "cuda")
    except Exception as e:
        gpu, gpu_log = None, ""
        failures.append(f"the GPU server: {type(e).__name__}: {e}")
    try:
        cpu, _ = run(kura, model, "cpu")
    except Exception as e:
        cpu = None
        failures.append(f"the CPU server: {type(e).__name__}: {e}")
    if gpu is not None:
        failures += guarded("the pool against kura plan", check_plan, kura, model, gpu_log)
        failures += guarded("the kernels named", check_prefill_kernel, gpu_log)
    failures += guarded("host tier", check_host_tier, kura, model, "cuda")
    if gpu is not None and cpu is not None:
        failures += guarded("against the CPU server", compare, gpu, cpu)
    if gpu is not None:
        failures += guarded("kura generate", check_generate, kura, model, gpu)
    failures += guarded("speculative decoding", check_speculative, kura, model, "cuda")
    if gpu is not None:
        failures += guarded("the kernel-timing server", check_tuning, kura, model, gpu)
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
