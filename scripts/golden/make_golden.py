#!/usr/bin/env python3
"""Golden vectors for kura-model, computed with HF transformers (float32, eager attention).

Writes into crates/kura-model/tests/data/:
  golden/default_model.json   the default model (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized by
                              transformers): last-position logits (top-64 ids and values, every 97th id,
                              mean and std of the full vector) and 16 greedy tokens for a few prompts,
                              plus the chat template's token ids from the reference tokenizer.
  tiny-llama/, tiny-qwen2/, tiny-mistral/
                              tiny random-weight HF directories (bf16 safetensors, a byte-level BPE
                              tokenizer, ChatML template): Llama with llama3 RoPE scaling and untied
                              head, Qwen2 with QKV bias and tied embeddings, Mistral with an 8-token
                              sliding window.
  golden/tiny-*.json          their full last-position logits and 12 greedy tokens for a few prompts.

Run with the reference environment:  /work/ref/venv/bin/python scripts/golden/make_golden.py [MODEL.gguf]
(the GGUF path defaults to $KURA_MODEL or ~/.cache/kura/models/SmolLM2-135M-Instruct.Q4_1.gguf).
Greedy continuations recompute the whole sequence at each step (no cache), so they are the plain
definition of greedy decoding.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "crates" / "kura-model" / "tests" / "data"
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOP = 64
STRIDE = 97

torch.manual_seed(0)
torch.set_num_threads(os.cpu_count() or 1)


def greedy(model, ids, n):
    seq = list(ids)
    first = None
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            if first is None:
                first = logits
            seq.append(int(torch.argmax(logits)))
    return seq[len(ids):], first


def summarize(logits, full):
    top = torch.topk(logits, TOP)
    out = {
        "top_ids": top.indices.tolist(),
        "top_values": top.values.tolist(),
        "sample_stride": STRIDE,
        "sample_values": logits[::STRIDE].tolist(),
        "mean": float(logits.double().mean()),
        "std": float(logits.double().std()),
        "vocab": logits.numel(),
    }
    if full:
        out["full"] = logits.tolist()
    return out


def default_model(gguf_path):
    d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cases = []
    for prompt in ["The capital of France is", "Once upon a time, there was a little", "def fibonacci(n):\n    "]:
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        gen, logits = greedy(model, ids, 16)
        cases.append({"prompt": prompt, "chat": False, "ids": ids, "greedy": gen, "logits": summarize(logits, False)})
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    chat_ids = [int(i) for i in chat_ids]
    gen, logits = greedy(model, chat_ids, 16)
    cases.append({"prompt": messages, "chat": True, "ids": chat_ids, "greedy": gen, "logits": summarize(logits, False)})
    templates = []
    for msgs in [
        messages,
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2? Émoji 🙂 ok"}],
    ]:
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        templates.append({"messages": msgs, "text": text, "ids": ids})
    out = {"source": f, "transformers_dtype": "float32", "cases": cases, "chat_templates": templates}
    (DATA / "golden").mkdir(parents=True, exist_ok=True)
    (DATA / "golden" / "default_model.json").write_text(json.dumps(out, indent=1))
    print("default model:", [tok.decode(c["greedy"]) for c in cases])


def byte_tokenizer(path):
    """A byte-level BPE with the 256 byte symbols, a few merges and ChatML's special tokens."""
    bl = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(sorted(bl))}
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n")]:
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(specials)
    t.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=1))
    return len(vocab)


def tiny_model(name, cfg_cls, **kw):
    path = DATA / f"tiny-{name}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    vocab = byte_tokenizer(path)
    cfg = cfg_cls(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for n, p in model.named_parameters():
            # Large enough weights that logits have a clear ranking; norms near 1.
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if "bias" in n else 0.15))
            # Stored in bf16: round here so the reference computes with the stored values.
            p.copy_(p.to(torch.bfloat16).float())
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    # Reload what was written, in float32: casting the live model back would leave its RoPE buffers
    # rounded to bf16, which is not what a fresh load computes.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(len(name))
    cases = []
    for length in [5, 23]:
        ids = torch.randint(0, vocab - 3, (length,), generator=g).tolist()
        gen, logits = greedy(model, ids, 12)
        cases.append({"ids": ids, "greedy": gen, "logits": summarize(logits, True)})
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("the hen ran in", add_special_tokens=False)["input_ids"]
    gen, logits = greedy(model, ids, 12)
    cases.append({"prompt": "the hen ran in", "ids": ids, "greedy": gen, "logits": summarize(logits, True)})
    out = {"config": cfg.to_dict()["model_type"], "cases": cases}
    (DATA / "golden" / f"tiny-{name}.json").write_text(json.dumps(out, indent=1))
    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"tiny-{name}: {size} bytes, greedy {[c['greedy'][:4] for c in cases]}")


def main():
    gguf_path = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(
        "KURA_MODEL", os.path.expanduser("~/.cache/kura/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    (DATA / "golden").mkdir(parents=True, exist_ok=True)
    # GOLDEN_ONLY=name makes just that tiny model and leaves the other files as they are.
    only = os.environ.get("GOLDEN_ONLY")
    tiny = {
        "llama": lambda: tiny_model(
            "llama", LlamaConfig, tie_word_embeddings=False, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2": lambda: tiny_model("qwen2", Qwen2Config, tie_word_embeddings=True, rope_theta=1000000.0),
        "mistral": lambda: tiny_model("mistral", MistralConfig, tie_word_embeddings=False, sliding_window=8,
                                      rope_theta=10000.0),
        # Qwen2 slides only the layers from max_window_layers on: layer 0 full, layer 1 a window of 8.
        "qwen2-swa": lambda: tiny_model("qwen2-swa", Qwen2Config, tie_word_embeddings=True,
                                        rope_theta=1000000.0, use_sliding_window=True, sliding_window=8,
                                        max_window_layers=1),
    }
    for name, make in tiny.items():
        if only is None or only == name:
            make()
    if only is None and os.environ.get("GOLDEN_SKIP_DEFAULT") != "1":
        default_model(gguf_path)


if __name__ == "__main__":
    main()
