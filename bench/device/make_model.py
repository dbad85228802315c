#!/usr/bin/env python3
"""Make an HF-format Llama model in SmolLM2-135M-Instruct's shape with random bf16 weights: the model of the
CPU thread-scaling bench on a machine the default model (a 98 MB GGUF) cannot be carried to.

    python3 bench/device/make_model.py OUT_DIR TOKENIZER_DIR [--layers N]

Writes OUT_DIR/config.json, OUT_DIR/model.safetensors and TOKENIZER_DIR's tokenizer files (what
scripts/gpu/tokenizer.sh writes from the default model's GGUF), for llama.cpp's convert_hf_to_gguf.py. The
shape is scripts/gpu/make_models.py's "smol" (hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV
heads, vocab 49152, tied embeddings, rope_theta 100000); --layers N cuts it to N layers (a quick test).
Decode and prefill speed do not depend on the weights' values, only on the shape and the quantization,
so its timings stand for SmolLM2-135M-Instruct's (the text it writes is nonsense).

Needs torch + transformers (5.x: `rope_parameters`, `dtype`). Seeded: the same weights every run.
"""
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPE = dict(
    hidden_act="silu", rms_norm_eps=1e-5, initializer_range=0.02, attention_bias=False, mlp_bias=False,
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
    bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def main() -> None:
    argv = sys.argv[1:]
    layers = None
    if "--layers" in argv:
        i = argv.index("--layers")
        layers = int(argv[i + 1])
        del argv[i:i + 2]
    if len(argv) != 2 or any(a.startswith("--") for a in argv):
        sys.exit(__doc__)
    out, tok_dir = Path(argv[0]), Path(argv[1])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (tok_dir / name).is_file():
            sys.exit(f"make_model: {tok_dir / name} is missing")
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # parameters are created in bf16, never cast
    shape = dict(SHAPE)
    if layers is not None:
        shape["num_hidden_layers"] = layers
    config = LlamaConfig(**shape)
    config.dtype = torch.bfloat16
    with torch.no_grad():
        model = LlamaForCausalLM(config)  # random init: normal(0, initializer_range), norms at 1
    model.save_pretrained(out)  # transformers 5 writes safetensors
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"  # 5.x writes "dtype"; older readers look for "torch_dtype"
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        if (tok_dir / f).is_file():
            shutil.copy(tok_dir / f, out / f)
    n = sum(p.numel() for p in model.parameters())
    print(f"make_model: torch {torch.__version__}, {config.num_hidden_layers} layers, {n / 1e6:.1f} M parameters"
          f" (bf16) in {out}, {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
