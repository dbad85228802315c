#!/usr/bin/env python3
"""Make HF-format Llama models with random bf16 weights, and HF transformers' reference outputs for them.

    python3 scripts/gpu/make_models.py OUT_DIR TOKENIZER_DIR [--small | --preflight]

Writes, for Kura-vs-transformers correctness tests of the CUDA executor:
  OUT_DIR/prompts.json             3 token-id lists (random.Random(1234), ids in [3, 49152)), lengths 37, 300, 1000
  OUT_DIR/smol/                    SmolLM2-135M-Instruct's shape (30 layers, tied embeddings)
  OUT_DIR/smolw/                   the same shape with initializer_range 0.05 (varied greedy text)
  OUT_DIR/llama8b4/                Llama-3.1-8B's shape, 4 layers (llama3 RoPE scaling, untied)
each model dir holding config.json, model.safetensors (bf16), TOKENIZER_DIR's tokenizer files, and per prompt i:
  hf_logits_<i>.f32                the last prompt position's logits, raw little-endian float32 (vocab_size values)
  hf32_logits_<i>.f32              the same from the same weights computed in float32 (no TF32): what both bf16
                                   runs (HF's and Kura's) are measured against, to tell their rounding apart
  hf_greedy_<i>.json               24 greedy tokens after the prompt (pure argmax: no EOS stop, no logits processors)

Needs torch + transformers (5.x: `rope_parameters`, `dtype`, `logits_to_keep`). Uses the GPU when there is one.
--small (for a CPU smoke test): 2 layers per model and prompts of 37, 64 and 100 tokens.
--preflight (for scripts/gpu/preflight.sh, whose stand-in driver runs the kernels on the CPU): 2 layers per
model, llama8b4 narrowed to hidden 1024 (8 heads of 128, 2 KV heads, intermediate 3584), the prompts as
above.
"""
import inspect
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

GREEDY_TOKENS = 24
PROMPT_SEED, PROMPT_LO, PROMPT_HI = 1234, 3, 49152  # ids valid in both vocabularies (49152 <= 128256)

COMMON = dict(hidden_act="silu", rms_norm_eps=1e-5, initializer_range=0.02, attention_bias=False, mlp_bias=False)
MODELS = {
    # SmolLM2-135M-Instruct's shape.
    "smol": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
        bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    # SmolLM2's shape with a wider weight spread: greedy text that does not settle on one token (the
    # greedy tests); the models above keep HF's default initializer_range (0.02).
    "smolw": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
        bos_token_id=1, eos_token_id=2, initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    # Llama-3.1-8B's shape, cut to 4 layers.
    "llama8b4": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_id=128001,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    small = "--small" in sys.argv[1:]
    preflight = "--preflight" in sys.argv[1:]
    if len(args) != 2 or any(a not in ("--small", "--preflight") for a in sys.argv[1:] if a.startswith("--")):
        sys.exit(__doc__)
    out, tok_dir = Path(args[0]), Path(args[1])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (tok_dir / name).is_file():
            sys.exit(f"make_models: {tok_dir / name} is missing")
    out.mkdir(parents=True, exist_ok=True)

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"make_models: torch {torch.__version__}, device {dev}"
          + (f" ({torch.cuda.get_device_name()})" if dev.type == "cuda" else ""), flush=True)

    rng = random.Random(PROMPT_SEED)
    lengths = (37, 64, 100) if small else (37, 300, 1000)
    prompts = [[rng.randrange(PROMPT_LO, PROMPT_HI) for _ in range(n)] for n in lengths]
    (out / "prompts.json").write_text(json.dumps(prompts))

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # parameters are created in bf16, never cast
    for name, shape in MODELS.items():
        t0 = time.perf_counter()
        if small or preflight:
            shape = dict(shape, num_hidden_layers=2)
        if preflight and name == "llama8b4":
            shape = dict(shape, hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2)
        config = LlamaConfig(**{**COMMON, **shape})
        config.dtype = torch.bfloat16
        config._attn_implementation = "sdpa"
        with torch.device(dev):
            model = LlamaForCausalLM(config)  # random init: normal(0, initializer_range), norms at 1
        model.eval()
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        # The KV cache's argument and output: `cache` from transformers 5.2x on (`past_key_values`
        # deprecated), `past_key_values` before.
        cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

        mdir = out / name
        mdir.mkdir(exist_ok=True)
        model.save_pretrained(mdir)  # transformers 5 always writes safetensors (no safe_serialization argument)
        cfg_path = mdir / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"  # 5.x writes "dtype"; older readers look for "torch_dtype"
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (tok_dir / f).is_file():
                shutil.copy(tok_dir / f, mdir / f)

        with torch.no_grad():
            for i, prompt in enumerate(prompts):
                ids = torch.tensor([prompt], device=dev)
                # One batch-1 forward of the whole prompt (into a fresh DynamicCache); only the last
                # position's logits are computed.
                o = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                logits = o.logits[0, -1].float()
                logits.cpu().numpy().astype("<f4").tofile(mdir / f"hf_logits_{i}.f32")
                # Greedy: pure argmax over the full vocabulary, one token at a time on the cache.
                toks = [int(logits.argmax())]
                while len(toks) < GREEDY_TOKENS:
                    cache = getattr(o, "cache", None)
                    cache = o.past_key_values if cache is None else cache
                    o = model(input_ids=torch.tensor([[toks[-1]]], device=dev), use_cache=True, **{cache_arg: cache})
                    toks.append(int(o.logits[0, -1].argmax()))
                (mdir / f"hf_greedy_{i}.json").write_text(json.dumps(toks))
            # The float32 reference: the same bf16 weights upcast exactly, every product in float32.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            model.float()
            for i, prompt in enumerate(prompts):
                o = model(input_ids=torch.tensor([prompt], device=dev), use_cache=False, logits_to_keep=1)
                o.logits[0, -1].float().cpu().numpy().astype("<f4").tofile(mdir / f"hf32_logits_{i}.f32")
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"make_models: {name}: {config.num_hidden_layers} layers, {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
