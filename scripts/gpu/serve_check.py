"""`kura serve --device cuda` through the official openai client: a long prompt sent twice is cold the
first time and served from cached blocks the second, with exactly the prompt's whole blocks but the
last token's reported as `cached_tokens`, and the same greedy text. Usage: serve_check.py KURA MODEL_DIR.
Exits non-zero on any failure."""

import random
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai

BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    kura, model = sys.argv[1], sys.argv[2]
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [kura, "serve", "--device", "cuda", "--model", model, "--port", str(port), "--kv-cache-memory", "0.5",
         "--block-size", str(BLOCK)],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while time.time() - t0 < 120:
            if proc.poll() is not None:
                log.seek(0)
                print(log.read())
                print(f"FAIL: kura serve exited with {proc.returncode}")
                return 1
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            print("FAIL: kura serve did not become healthy")
            return 1
        print(f"kura serve --device cuda healthy in {time.time() - t0:.1f} s")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        name = client.models.list().data[0].id
        rng = random.Random(5)
        words = " ".join(rng.choice(["cache", "block", "token", "device", "memory", "prefix", "reuse",
                                     "tenant", "layer", "kernel"]) for _ in range(700))
        failures = []
        for kind in ["completions", "chat"]:
            def ask():
                t = time.perf_counter()
                if kind == "completions":
                    r = client.completions.create(model=name, prompt=words, max_tokens=16, temperature=0)
                    text = r.choices[0].text
                else:
                    r = client.chat.completions.create(
                        model=name, max_tokens=16, temperature=0,
                        messages=[{"role": "system", "content": words}, {"role": "user", "content": "Summarise."}])
                    text = r.choices[0].message.content
                return r.usage, text, time.perf_counter() - t
            cold, cold_text, cold_s = ask()
            warm, warm_text, warm_s = ask()
            n = cold.prompt_tokens
            want = (n - 1) // BLOCK * BLOCK
            got = (cold.prompt_tokens_details.cached_tokens, warm.prompt_tokens_details.cached_tokens)
            print(f"{kind}: {n} prompt tokens; cached_tokens cold {got[0]}, warm {got[1]} (expected 0, {want}); "
                  f"cold {cold_s * 1e3:.0f} ms, warm {warm_s * 1e3:.0f} ms; same text: {cold_text == warm_text}")
            if got != (0, want):
                failures.append(f"{kind}: cached_tokens {got}, expected (0, {want})")
            if cold_text != warm_text:
                failures.append(f"{kind}: the cached answer differs: {cold_text!r} vs {warm_text!r}")
        for f in failures:
            print("FAIL:", f)
        return 1 if failures else 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
