#!/usr/bin/env python3
"""HF transformers peer for Kura's GPU benchmarks: Llama-3.1-8B's shape, random bf16 weights.

    python3 bench/gpu/hf_peer.py [--small]

Builds LlamaForCausalLM (32 layers, random weights made directly on the GPU in bf16, sdpa attention,
torch.manual_seed(0)) and measures, after a warm-up, with torch.cuda.synchronize + time.perf_counter:
  prefill      TTFT of a 4,096- and a 16,384-token prompt, batch 1: the whole prompt's forward (into a
               DynamicCache, logits of the last position only) + argmax; median of 3
  decode       batch 1 after a 1,024-token prompt: 64 greedy single-token steps timed together; and
               batch 64 with 1,024 tokens of context each: 16 greedy steps; median of 3 runs each, every
               run on its own copy of the prefilled cache
  cached_ttft  a 4,096-token prompt whose first 4,080 tokens are cached: the forward of the last 16 tokens
               on a copy of the 4,080-token cache + argmax; median of 10
Output: one JSON line first with the torch/transformers versions and the GPU; one JSON line per result;
the last line one JSON object with everything. --small: 2 small layers and short prompts (a CPU smoke test).
"""
import sys

if sys.argv[1:] in (["-h"], ["--help"]):
    print(__doc__)
    sys.exit(0)
if sys.argv[1:] not in ([], ["--small"]):
    sys.exit(f"hf_peer.py: unknown arguments {sys.argv[1:]}; usage: hf_peer.py [--small]")

import copy
import inspect
import json
import statistics
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

SMALL = "--small" in sys.argv[1:]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
    bos_token_id=128000, eos_token_id=128001, rms_norm_eps=1e-5, hidden_act="silu", initializer_range=0.02,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
if SMALL:
    SHAPE = dict(LLAMA_8B, hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=32000, bos_token_id=1, eos_token_id=2)
    PREFILL, DEC1, DECB, CACHED = (256, 1024), (128, 8), (4, 128, 4), (512, 496)
else:
    SHAPE = LLAMA_8B
    PREFILL = (4096, 16384)    # prompt lengths
    DEC1 = (1024, 64)          # context, steps (batch 1)
    DECB = (64, 1024, 16)      # batch, context, steps
    CACHED = (4096, 4080)      # prompt, cached prefix

RESULTS = []


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def emit(**kv) -> None:
    line = {"peer": "hf", **kv}
    RESULTS.append(line)
    print(json.dumps(line), flush=True)


def timed(fn) -> float:
    """Milliseconds of fn(), GPU work included."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    print(json.dumps({"peer": "hf", "what": "env", "torch": torch.__version__, "transformers": transformers.__version__,
                      "gpu": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
                      "layers": SHAPE["num_hidden_layers"], "small": SMALL}), flush=True)

    t0 = time.perf_counter()
    config = LlamaConfig(**SHAPE)
    config.dtype = torch.bfloat16
    config._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEV):
        model = LlamaForCausalLM(config).eval()  # random init straight into bf16 on the device
    sync()
    print(json.dumps({"peer": "hf", "what": "init", "s": round(time.perf_counter() - t0, 2)}), flush=True)

    # transformers >= 4.50 / 5.x: logits_to_keep; 4.45-4.49: num_logits_to_keep; older: neither (all logits).
    params = inspect.signature(model.forward).parameters
    keep = next(({k: 1} for k in ("logits_to_keep", "num_logits_to_keep") if k in params), {})
    # The KV cache's argument and output: `cache` from transformers 5.2x on (`past_key_values`
    # deprecated), `past_key_values` before.
    cache_arg = "cache" if "cache" in params else "past_key_values"

    def cache_of(o):
        c = getattr(o, "cache", None)
        return o.past_key_values if c is None else c

    def ids(batch: int, n: int) -> torch.Tensor:
        return torch.randint(3, SHAPE["vocab_size"], (batch, n), generator=gen).to(DEV)

    def prefill(x: torch.Tensor, cache=None):
        """Forward of x (into cache, or a new DynamicCache) + argmax of the last position: (tokens, cache)."""
        o = model(input_ids=x, use_cache=True, **{cache_arg: cache}, **keep)
        return o.logits[:, -1].argmax(-1, keepdim=True), cache_of(o)

    def decode(tok: torch.Tensor, cache, steps: int) -> None:
        for _ in range(steps):
            o = model(input_ids=tok, use_cache=True, **{cache_arg: cache})
            tok = o.logits[:, -1].argmax(-1, keepdim=True)
            cache = cache_of(o)

    with torch.no_grad():
        # Prefill TTFT.
        for n in PREFILL:
            x = ids(1, n)
            timed(lambda: prefill(x))  # warm-up at this length
            runs = [timed(lambda: prefill(x)) for _ in range(3)]
            emit(what="prefill", tokens=n, ms=round(statistics.median(runs), 2), runs_ms=[round(r, 2) for r in runs])
        if DEV.type == "cuda":
            torch.cuda.empty_cache()

        # Decode: batch 1 and batch B, each run on its own copy of the prefilled cache.
        for batch, ctx, steps in ((1, *DEC1), DECB):
            tok, base = prefill(ids(batch, ctx))
            decode(tok, copy.deepcopy(base), min(steps, 4))  # warm-up
            runs = []
            for _ in range(3):
                c = copy.deepcopy(base)
                runs.append(timed(lambda: decode(tok, c, steps)))
                del c
            ms = statistics.median(runs)
            emit(what="decode", batch=batch, context=ctx, steps=steps, ms=round(ms, 2),
                 tokens_per_s=round(batch * steps / ms * 1e3, 1), ms_per_step=round(ms / steps, 3))
            del tok, base
            if DEV.type == "cuda":
                torch.cuda.empty_cache()

        # TTFT with a cached prefix: the last (prompt - cached) tokens on a copy of the cached prefix's KV.
        prompt, cached = CACHED
        x = ids(1, prompt)
        _, base = prefill(x[:, :cached])
        runs = []
        for i in range(12):  # 2 warm-up runs, then 10
            c = copy.deepcopy(base)
            ms = timed(lambda: prefill(x[:, cached:], c))
            assert c.get_seq_length() == prompt
            del c
            if i >= 2:
                runs.append(ms)
        emit(what="cached_ttft", prompt=prompt, cached=cached, ms=round(statistics.median(runs), 2),
             runs_ms=[round(r, 2) for r in runs])

    print(json.dumps({"peer": "hf", "what": "all", "torch": torch.__version__, "transformers": transformers.__version__,
                      "gpu": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
                      "layers": SHAPE["num_hidden_layers"], "small": SMALL,
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEV.type == "cuda" else None,
                      "results": RESULTS}), flush=True)


if __name__ == "__main__":
    main()
