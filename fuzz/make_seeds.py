#!/usr/bin/env python3
"""Writes the committed seed corpus of the fuzz targets (fuzz/seeds/<target>/): a few small valid inputs
each, from which libFuzzer mutates. Deterministic; run from anywhere: python3 fuzz/make_seeds.py"""
import json
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
SEEDS = os.path.join(HERE, "seeds")
rng = random.Random(7)

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)


def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gval(ty, v):
    if ty == STR:
        return gstr(v)
    if ty == ARR:
        ety, items = v
        return struct.pack("<IQ", ety, len(items)) + b"".join(gval(ety, x) for x in items)
    fmt = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B",
           U64: "<Q", I64: "<q", F64: "<d"}[ty]
    return struct.pack(fmt, v)


# bytes per block of 32 (or 256) elements, and the block size, per ggml type id
GGML = {0: (4, 1), 1: (2, 1), 30: (2, 1), 8: (34, 32), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32),
        12: (144, 256)}


def gguf(version, kvs, tensors):
    """kvs: [(key, type, value)]; tensors: [(name, dims innermost first, ggml type)]."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for k, ty, v in kvs:
        out += gstr(k) + struct.pack("<I", ty) + gval(ty, v)
    datas, offset = [], 0
    for name, dims, ty in tensors:
        n = 1
        for d in dims:
            n *= d
        per, blk = GGML[ty]
        size = n // blk * per
        data = bytes(rng.randrange(256) for _ in range(size))
        if ty == 0:
            data = b"".join(struct.pack("<f", rng.uniform(-1, 1)) for _ in range(n))
        out += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ty, offset)
        datas.append(data)
        offset += (len(data) + 31) // 32 * 32
    out += b"\0" * (-len(out) % 32)
    for d in datas:
        out += d + b"\0" * (-len(d) % 32)
    return out


def byte_level_alphabet():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def tiny_llama():
    template = open(os.path.join(HERE, "assets", "smollm2-chat-template.jinja")).read()
    tokens = byte_level_alphabet() + ["He", "ll", "Hell", "Hello", "<|endoftext|>", "<|im_start|>",
                                      "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    merges = ["H e", "l l", "He ll", "Hell o"]
    h, heads, kv, ffn, vocab = 32, 4, 2, 64, len(tokens)
    kvs = [
        ("general.architecture", STR, "llama"),
        ("general.alignment", U32, 32),
        ("llama.block_count", U32, 1),
        ("llama.context_length", U32, 128),
        ("llama.embedding_length", U32, h),
        ("llama.feed_forward_length", U32, ffn),
        ("llama.attention.head_count", U32, heads),
        ("llama.attention.head_count_kv", U32, kv),
        ("llama.rope.freq_base", F32, 10000.0),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("llama.vocab_size", U32, vocab),
        ("tokenizer.ggml.model", STR, "gpt2"),
        ("tokenizer.ggml.pre", STR, "smollm"),
        ("tokenizer.ggml.tokens", ARR, (STR, tokens)),
        ("tokenizer.ggml.token_type", ARR, (I32, types)),
        ("tokenizer.ggml.merges", ARR, (STR, merges)),
        ("tokenizer.ggml.bos_token_id", U32, vocab - 3),
        ("tokenizer.ggml.eos_token_id", U32, vocab - 1),
        ("tokenizer.ggml.add_bos_token", BOOL, 0),
        ("tokenizer.chat_template", STR, template),
    ]
    tensors = [
        ("token_embd.weight", [h, vocab], 8),
        ("blk.0.attn_norm.weight", [h], 0),
        ("blk.0.attn_q.weight", [h, heads * 8], 1),
        ("blk.0.attn_k.weight", [h, kv * 8], 3),
        ("blk.0.attn_v.weight", [h, kv * 8], 30),
        ("blk.0.attn_output.weight", [heads * 8, h], 8),
        ("blk.0.ffn_norm.weight", [h], 0),
        ("blk.0.ffn_gate.weight", [h, ffn], 2),
        ("blk.0.ffn_up.weight", [h, ffn], 6),
        ("blk.0.ffn_down.weight", [ffn, h], 7),
        ("output_norm.weight", [h], 0),
    ]
    return gguf(3, kvs, tensors)


def spm_mistral():
    pieces = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)] + ["\u2581", "\u2581H", "e",
                                                                               "l", "\u2581He", "ll"]
    types = [2, 3, 3] + [6] * 256 + [1] * 6
    kvs = [
        ("general.architecture", STR, "mistral"),
        ("mistral.block_count", U64, 2),
        ("mistral.context_length", U64, 4096),
        ("mistral.embedding_length", U64, 64),
        ("mistral.feed_forward_length", U64, 128),
        ("mistral.attention.head_count", U64, 4),
        ("mistral.attention.head_count_kv", U64, 1),
        ("mistral.attention.key_length", U64, 16),
        ("mistral.attention.sliding_window", U64, 32),
        ("mistral.attention.layer_norm_rms_epsilon", F64, 1e-6),
        ("tokenizer.ggml.model", STR, "llama"),
        ("tokenizer.ggml.tokens", ARR, (STR, pieces)),
        ("tokenizer.ggml.scores", ARR, (F32, [float(-i) for i in range(len(pieces))])),
        ("tokenizer.ggml.token_type", ARR, (I32, types)),
        ("tokenizer.ggml.bos_token_id", U32, 1),
        ("tokenizer.ggml.eos_token_id", U32, 2),
        ("tokenizer.chat_template", STR, "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} "
                                         "[/INST]{% endfor %}"),
        ("general.tags", ARR, (ARR, [(U8, [1, 2]), (I16, [-3])])),
    ]
    return gguf(3, kvs, [("blk.0.attn_norm.weight", [64], 0), ("blk.0.ffn_down.weight", [256, 2], 12)])


def qwen2_v2():
    kvs = [
        ("general.architecture", STR, "qwen2"),
        ("qwen2.block_count", U32, 2),
        ("qwen2.context_length", U32, 256),
        ("qwen2.embedding_length", U32, 64),
        ("qwen2.feed_forward_length", U32, 128),
        ("qwen2.attention.head_count", U32, 4),
        ("qwen2.attention.layer_norm_rms_epsilon", F32, 1e-6),
        ("qwen2.rope.freq_base", F32, 1e6),
        ("qwen2.vocab_size", I64, 265),
    ]
    return gguf(2, kvs, [("output.weight", [64, 16], 1)])


def write(target, name, data):
    d = os.path.join(SEEDS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


write("gguf", "tiny-llama.gguf", tiny_llama())
write("gguf", "spm-mistral-swa.gguf", spm_mistral())
write("gguf", "qwen2-v2.gguf", qwen2_v2())

smollm2 = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
           "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192,
           "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
           "num_key_value_heads": 3, "rms_norm_eps": 1e-05,
           "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True, "vocab_size": 49152}
write("hf_config", "smollm2-135m.json", json.dumps(smollm2, indent=2))
write("hf_config", "qwen2-swa.json", open(os.path.join(HERE, "..", "crates", "kura-model", "tests", "data",
                                                       "tiny-qwen2-swa", "config.json")).read())
llama3 = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
          "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
          "max_position_embeddings": 131072, "rope_theta": 500000.0, "attention_bias": False,
          "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
write("hf_config", "llama3-8b.json", json.dumps(llama3))
deepseek = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
            "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
            "num_experts_per_tok": 8, "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
            "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
            "max_position_embeddings": 163840}
write("hf_config", "deepseek-v3.json", json.dumps(deepseek))
gemma3 = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
          "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
          "vocab_size": 262208, "max_position_embeddings": 131072.0}}
write("hf_config", "gemma3-multimodal.json", json.dumps(gemma3))
mistral = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096, "vocab_size": 32000,
           "layer_types": ["sliding_attention"] * 32, "rope_parameters": {"rope_theta": 10000.0}}
write("hf_config", "mistral-swa.json", json.dumps(mistral))

# chat_template: flags byte, then NUL-separated fields (see fuzz_targets/chat_template.rs).
def chat(flags, fields):
    return bytes([flags]) + b"\0".join(f.encode() for f in fields)

write("chat_template", "smollm2-two-turns", chat(1, ["<|im_start|>", "<|im_end|>", "user", "Hi",
                                                     "assistant", "Hello!", "user", "Bye"]))
write("chat_template", "chatml-system", chat(2, ["", "<|im_end|>", "system", "Be brief.", "user", "2+2?"]))
llama3_tpl = ("{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
              "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
              "{%- endif %}")
write("chat_template", "source-llama3", chat(5, [llama3_tpl, "<|begin_of_text|>", "<|eot_id|>", "user", "Hi"]))
alt_tpl = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% else %}"
           "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
           "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
           "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
write("chat_template", "source-mistral-alternate", chat(4, [alt_tpl, "<s>", "</s>", "user", " a ",
                                                            "assistant", "b", "user", "c"]))
macro_tpl = ("{% macro render(m, depth) %}{% if depth > 0 %}{{ render(m, depth - 1) }}{% endif %}"
             "{{ m.role | upper }}: {{ m.content | replace('a', 'b') | tojson }}{% endmacro %}"
             "{% for m in messages %}{{ render(m, 3) }}{{ m.content.split(' ') | join(',') }}{% endfor %}"
             "{{ range(3) | list }}{{ messages | length }}{{ 'x' * 3 }}")
write("chat_template", "source-macros-filters", chat(6, [macro_tpl, "", "", "user", "a b c"]))

# trace_line: Mooncake lines (kura-sim and kura-bench) and an Azure CSV (kura-bench).
mooncake = ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 7]}\n'
            '{"timestamp": 27, "input_length": 512, "output_length": 12, "hash_ids": [0]}\n'
            '{"timestamp": 27, "input_length": 1, "output_length": 1, "hash_ids": [8388607]}\n')
write("trace_line", "mooncake.jsonl", mooncake)
write("trace_line", "mooncake-one.jsonl",
      '{"timestamp": 5, "input_length": 1025, "output_length": 3, "hash_ids": [1, 2, 3]}')
write("trace_line", "azure.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                 "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")

# request_json: flags byte (bit 0 chat, bit 1 priority scheduling), then the body.
def request(flags, body):
    return bytes([flags]) + json.dumps(body).encode()

write("request_json", "completion-full", request(0, {
    "model": "model", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.7, "top_p": 0.9,
    "top_k": 40, "n": 2, "stop": ["\n", "END"], "logprobs": 5, "echo": False, "seed": 7, "stream": True,
    "stream_options": {"include_usage": True}, "presence_penalty": 0.5, "frequency_penalty": 0.1,
    "user": "u", "priority": 0}))
write("request_json", "completion-batched", request(2, {
    "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4, "priority": -3}))
write("request_json", "completion-strings", request(0, {"prompt": ["a", "b", "c"], "max_tokens": 1}))
write("request_json", "chat-full", request(1, {
    "model": "model", "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                   {"role": "assistant", "content": "Hello"},
                                   {"role": "user", "content": "2+2?"}],
    "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 3, "stop": "x", "n": 1,
    "stream": False, "temperature": 0}))
write("request_json", "chat-priority", request(3, {
    "messages": [{"role": "user", "content": "Hi"}], "priority": 5, "max_tokens": 2}))
write("request_json", "chat-tools", request(1, {
    "messages": [{"role": "user", "content": "Weather?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "c1", "type": "function",
                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "4C"}],
    "tools": [{"type": "function", "function": {"name": "get_weather",
                                                "parameters": {"type": "object"}}}],
    "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 8}))
write("request_json", "completion-structured", request(0, {
    "prompt": "x", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "array", "items": {"type": "integer"}}}},
    "structured_outputs": {"regex": "[0-9]+"}}))

# messages_json: Anthropic Messages bodies.
write("messages_json", "full", json.dumps({
    "model": "model", "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
    "stop_sequences": ["END"], "stream": True,
    "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "A long document.",
                                               "cache_control": {"type": "ephemeral"}}]},
                 {"role": "assistant", "content": "Read."},
                 {"role": "user", "content": "Summarise it."}]}))
write("messages_json", "top-level-cache-control", json.dumps({
    "model": "model", "max_tokens": 8, "cache_control": {"type": "ephemeral", "ttl": "5m"},
    "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]}))
write("messages_json", "cached-content", json.dumps({
    "max_tokens": 4, "cached_content": "ctx-0123456789abcdef", "messages": [{"role": "user", "content": "Q?"}]}))

write("messages_json", "tools", json.dumps({
    "model": "model", "max_tokens": 64,
    "tools": [{"name": "get_weather", "description": "Weather", "cache_control": {"type": "ephemeral"},
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    "output_config": None,
    "messages": [{"role": "user", "content": "Weather?"},
                 {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                   {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                    "input": {"city": "Oslo"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "4C",
                                               "cache_control": {"type": "ephemeral"}},
                                              {"type": "text", "text": "And tomorrow?"}]}]}))

# A count_tokens body (no max_tokens): read by prepare_count as well as refused by prepare.
write("messages_json", "count-tokens", json.dumps({
    "model": "model", "cache_control": {"type": "ephemeral"},
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
    "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
    "tool_choice": {"type": "tool", "name": "get_weather"}, "thinking": {"type": "disabled"},
    "messages": [{"role": "user", "content": "Weather?"}]}))

# responses_json: Responses bodies.
write("responses_json", "items-and-tools", json.dumps({
    "model": "model", "instructions": "Be brief.", "max_output_tokens": 32, "store": True,
    "previous_response_id": "resp_1", "parallel_tool_calls": False,
    "tools": [{"type": "function", "name": "get_weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
    "tool_choice": {"type": "function", "name": "get_weather"},
    "input": [{"role": "developer", "content": "Use tools."},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
              {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
              {"type": "function_call_output", "call_id": "c1", "output": "4C"}]}))
write("responses_json", "text-format", json.dumps({
    "model": "model", "input": "A person.", "stream": True, "truncation": "disabled", "include": [],
    "text": {"format": {"type": "json_schema", "name": "p", "strict": True,
                        "schema": {"type": "object", "properties": {"age": {"type": "integer"}}}}}}))

# An input_tokens body: only the fields a token count takes, `model` left out.
write("responses_json", "input-tokens", json.dumps({
    "instructions": "Be brief.", "previous_response_id": "resp_1", "truncation": "disabled",
    "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    "tool_choice": "required", "parallel_tool_calls": True, "reasoning": {"effort": None},
    "text": {"format": {"type": "json_object"}}, "input": [{"role": "user", "content": "Weather?"}]}))

# block_record: 8 bytes of block seed, a damage byte, then the payload or the (position, value) triples.
for name, seed, damage, rest in [("intact-overwrites", 7, 0, bytes(range(60))),
                                 ("truncated", 1234567, 1, b"\x01" * 64),
                                 ("other-block", 99, 2, b"payload"),
                                 ("other-fingerprint", 5, 3, b""),
                                 ("other-size", 42, 4, b"\xff" * 128)]:
    write("block_record", name, seed.to_bytes(8, "little") + bytes([damage]) + rest)
