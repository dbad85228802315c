"""`kura serve --device cuda` on a machine without a GPU, through the official openai client: the stand-in
NVIDIA driver and cuBLAS of crates/kura-cuda/emu (built by its build.sh, found through LD_LIBRARY_PATH) run
Kura's CUDA kernels on the CPU, so the whole GPU server runs: the engine, the CUDA executor, its graphs and
copies, the device pool sized against `kura plan --gpu`, and the host tier's asynchronous copies through
pinned memory. The checks are those scripts/gpu/serve_check.py makes on a GPU (scripts/test-gpu.sh), on a
small random model in Llama's layout (2 layers, 4 heads of 64) written here: exact `cached_tokens` against
the CPU server, the same text cold and cached and as the CPU's, the pool against the plan, and revisits
served from the host tier with the cold text.

Needs a C++ compiler ($KURA_CXX, scripts/fetch-cxx.sh) and NVRTC with the CUDA headers ($KURA_NVRTC_LIB,
$KURA_CUDA_INCLUDE, scripts/fetch-nvrtc.sh); scripts/test.sh sets them. Without them the test fails."""

import json
import os
import random
import shutil
import struct
import subprocess
import sys

import pytest

from conftest import ROOT, kura_bin

sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
import serve_check  # noqa: E402

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 2, 4, 2, 64, 265


def bf16(x: float) -> bytes:
    """`x` as bf16 (rounded to nearest even), little-endian."""
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    u += 0x7FFF + ((u >> 16) & 1)
    return struct.pack("<H", (u >> 16) & 0xFFFF)


def write_model(out) -> None:
    """An HF Llama checkpoint with random bf16 weights and the tokenizer of kura-model's tiny-llama."""
    out.mkdir(parents=True, exist_ok=True)
    tiny = ROOT / "crates" / "kura-model" / "tests" / "data" / "tiny-llama"
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(tiny / f, out / f)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "tie_word_embeddings": True,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    (out / "config.json").write_text(json.dumps(config))
    rng = random.Random(7)
    # 256 bf16 codes of each spread, drawn from: the weights' values without a call per value.
    table = {s: [bf16(rng.uniform(-s, s)) for _ in range(256)] for s in (0.5, 0.15)}
    norms = [bf16(1 + rng.uniform(-0.2, 0.2)) for _ in range(256)]
    tensors = [("model.embed_tokens.weight", [VOCAB, HIDDEN], table[0.5]), ("model.norm.weight", [HIDDEN], norms)]
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        for name, shape in [("self_attn.q_proj", [q, HIDDEN]), ("self_attn.k_proj", [kv, HIDDEN]),
                            ("self_attn.v_proj", [kv, HIDDEN]), ("self_attn.o_proj", [HIDDEN, q]),
                            ("mlp.gate_proj", [INTER, HIDDEN]), ("mlp.up_proj", [INTER, HIDDEN]),
                            ("mlp.down_proj", [HIDDEN, INTER])]:
            tensors.append((f"{p}.{name}.weight", shape, table[0.15]))
        for norm in ["input_layernorm", "post_attention_layernorm"]:
            tensors.append((f"{p}.{norm}.weight", [HIDDEN], norms))
    header, blobs, at = {}, [], 0
    for name, shape, codes in tensors:
        n = 1
        for d in shape:
            n *= d
        blob = b"".join(rng.choice(codes) for _ in range(n))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """(the folder of the stand-in libcuda.so and libcublas.so, the model's folder)."""
    for var in ["KURA_NVRTC_LIB", "KURA_CUDA_INCLUDE"]:
        if not os.environ.get(var):
            pytest.fail(f"{var} is not set: scripts/test.sh sets it (scripts/fetch-nvrtc.sh)", pytrace=False)
    work = tmp_path_factory.mktemp("emulated-gpu")
    libs = work / "lib"
    built = subprocess.run(["bash", str(ROOT / "crates" / "kura-cuda" / "emu" / "build.sh"), str(libs)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    write_model(work / "model")
    return str(libs), str(work / "model")


def on_emulated_device(monkeypatch, libs: str, kernels: str = "default") -> None:
    """Commands run from here on load the stand-in driver from `libs`, with `KURA_GPU_KERNELS=kernels`: by
    default the default kernels, untimed, since timing every form over a prompt of up to 4,096 tokens
    (what `auto` does when a GPU executor starts) takes the emulation minutes."""
    monkeypatch.setenv("LD_LIBRARY_PATH", libs + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    monkeypatch.setenv("KURA_GPU_KERNELS", kernels)
    # The emulated kernels answer in seconds where a GPU takes milliseconds: the server check's requests
    # get ten minutes here.
    monkeypatch.setattr(serve_check, "REQUEST_TIMEOUT_S", 600)


def test_the_gpu_server_on_the_emulated_device_answers_as_the_cpu_server_and_serves_revisits_from_the_host_tier(
        emulated, monkeypatch):
    libs, model = emulated
    on_emulated_device(monkeypatch, libs)
    # A device of 2 GiB: the plan's CUDA context and reserve leave a pool of some hundreds of MiB.
    monkeypatch.setenv("KURA_EMU_MEMORY_MB", "2048")
    kura = kura_bin()
    gpu, gpu_log = serve_check.run(kura, model, "cuda", words=60)
    assert "Kura emulated GPU" in gpu_log, gpu_log[-3000:]
    cpu, _ = serve_check.run(kura, model, "cpu", words=60)
    failures = serve_check.check_plan(kura, model, gpu_log)
    failures += serve_check.check_prefill_kernel(gpu_log)
    # 16 KiB a block of bf16 KV: a pool of 64 blocks, four prompts of about 20 blocks each, so that the
    # pool evicts and the revisits come back from the host tier.
    failures += serve_check.check_host_tier(kura, model, "cuda", pool=str(64 * 16 * 1024), words=60)
    failures += serve_check.compare(gpu, cpu)
    failures += serve_check.check_speculative(kura, model, "cuda", words=40)
    for kind in ["completions", "chat"]:
        if gpu[kind][2] != cpu[kind][2]:
            failures.append(f"{kind}: the GPU's text {gpu[kind][2]!r}, the CPU's {cpu[kind][2]!r}")
    assert not failures, failures


def test_perplexity_on_the_emulated_gpu_is_exact_in_f32_kv_and_finite_in_bf16_and_fp8(emulated, monkeypatch, tmp_path):
    """`kura perplexity --device cuda` (every position's logits, several KV formats against the f32 run):
    the GPU path is deterministic, so f32 KV against its own f32 reference changes nothing, as
    scripts/test-gpu.sh checks on a device."""
    libs, model = emulated
    on_emulated_device(monkeypatch, libs)
    rng = random.Random(0)
    words = "the cache of keys and values is kept in blocks on a device for later".split()
    text = tmp_path / "text.txt"
    text.write_text(" ".join(rng.choice(words) for _ in range(400)))
    out = subprocess.run(
        [kura_bin(), "perplexity", "--model", model, "--text", str(text), "--device", "cuda", "--context", "256",
         "--chunks", "2", "--kv-dtype", "f32,bf16,fp8", "--json"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    formats = {f["kv_dtype"]: f for f in report["formats"]}
    assert set(formats) == {"f32", "bf16", "fp8"}, report
    assert formats["f32"]["kl_mean"] == 0 and formats["f32"]["perplexity_change_pct"] == 0, report
    for f in report["formats"]:
        assert 0 < f["perplexity"] < float("inf"), report
    # fp8 differs from the f32 run, a little. (bf16 does not here: a whole context in one step goes through
    # the prefill kernel, which reads K and V as bf16 from either pool.)
    assert 0 <= formats["bf16"]["kl_mean"] < formats["fp8"]["kl_mean"] < 1, report


def test_requests_preempted_to_the_host_tier_on_the_emulated_gpu_give_the_text_they_give_unpreempted(emulated, monkeypatch):
    """Six requests at once through a pool of 48 blocks: their prompts (about 10 blocks each) admit four,
    whose answers (48 tokens, 3 blocks each) outgrow the pool, so the engine swaps the most recent out to
    the host tier and back (`--preemption-mode swap`: block copies between the device pool and pinned host
    memory), and each answer is the one its prompt gets on a server with room for all six."""
    import concurrent.futures

    import httpx
    import openai

    libs, model = emulated
    on_emulated_device(monkeypatch, libs)
    prompts = [serve_check.prompt_text(random.Random(200 + i), 25) for i in range(6)]
    kura = kura_bin()

    def answers(flags: list[str]) -> tuple[list[str], dict]:
        proc, url, _ = serve_check.start(kura, model, "cuda", *flags)
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            name = client.models.list().data[0].id
            ask = lambda p: client.completions.create(model=name, prompt=p, max_tokens=48, temperature=0,
                                                      extra_body={"ignore_eos": True}).choices[0].text
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                texts = list(pool.map(ask, prompts))
            metrics = httpx.get(url + "/metrics", timeout=10).text
            return texts, {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                           for line in metrics.splitlines() if line and not line.startswith("#")}
        finally:
            serve_check.stop(proc)

    # Prompts whole within the step's budget on both servers: on a GPU a prompt computed in other chunks
    # sums in another order (as a different batch does), and `--prefill-step-ms` cuts prompts beside
    # decodes where the wall clock says, which the slow emulated kernels make every step.
    whole = ["--prefill-step-ms", "0"]
    roomy, roomy_metrics = answers(["--kv-cache-memory", "64MiB", *whole])
    tight, metrics = answers(["--kv-cache-memory", str(48 * 16 * 1024), "--kv-host-memory", "64MiB",
                              "--preemption-mode", "swap", *whole])
    print("preemptions:", metrics.get("kura:num_preemptions_total"))
    assert roomy_metrics.get("kura:num_preemptions_total") == 0
    assert metrics.get("kura:num_preemptions_total", 0) > 0, "the pool of 48 blocks never ran out"
    assert tight == roomy


def test_generate_on_the_emulated_gpu_reports_the_device_not_cpu_threads(emulated, monkeypatch):
    """`kura generate --device cuda --json` says which device ran the model and reports no CPU thread count,
    how often CPU threads gave their core away, nor their decode team size (the CPU's threads do not run
    it); the same command on the CPU reports all three."""
    libs, model = emulated
    on_emulated_device(monkeypatch, libs)
    reports = {}
    for device in ["cuda", "cpu"]:
        out = subprocess.run(
            [kura_bin(), "generate", "--model", model, "--prompt", "the cache of keys", "--max-tokens", "4",
             "--ignore-eos", "--device", device, "--threads", "2", "--json"],
            capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        reports[device] = json.loads(out.stdout)
    gpu, cpu = reports["cuda"], reports["cpu"]
    assert gpu["device"] == "cuda:0" and gpu["threads"] is None and gpu["gave_way"] is None, gpu
    assert gpu["pace"] is None, gpu
    assert cpu["device"] == "cpu" and cpu["threads"] == 2, cpu
    assert set(cpu["gave_way"]) == {"same_cpu", "shared_core"}, cpu
    assert cpu["pace"]["threads"] == 2 and cpu["pace"]["size"] in (1, 2), cpu
    assert gpu["generated_tokens"] == cpu["generated_tokens"] == 4, (gpu, cpu)


def test_generate_on_the_emulated_gpu_samples_from_rows_copied_back_and_decodes_greedily_on_the_device(
        emulated, monkeypatch):
    """Greedy decoding takes the device's argmax (only token ids come back); a sampler that draws takes rows
    of logits copied back: top-k 1 there takes the greedy tokens; seeded, the same tokens on every run, and
    at temperature 2 over a random model not the greedy ones."""
    libs, model = emulated
    on_emulated_device(monkeypatch, libs)

    def generate(*sampling: str) -> list:
        out = subprocess.run(
            [kura_bin(), "generate", "--model", model, "--prompt", "the cache of keys", "--max-tokens", "12",
             "--ignore-eos", "--device", "cuda", "--json", *sampling],
            capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout)
        assert report["generated_tokens"] == 12, report
        return report["text"]

    greedy = generate()
    # Top-k 1 samples from the row copied back: the host's choice is the device's argmax.
    assert generate("--temperature", "1", "--top-k", "1", "--seed", "4") == greedy
    sampled = generate("--temperature", "2", "--seed", "3")
    assert generate("--temperature", "2", "--seed", "3") == sampled
    assert sampled != greedy, (sampled, greedy)


def test_generate_on_the_emulated_gpu_times_the_kernels_and_keeps_the_default_ones_tokens(emulated, monkeypatch):
    """With `KURA_GPU_KERNELS` unset (as `auto`) a GPU executor times every prefill attention form and every
    decode option over a prompt as long as its steps allow (here the prompt's ~100 tokens) and runs the
    fastest that give the default kernels' bits: the log names each one's time and those chosen, and the
    tokens are those of the default kernels (`default`) and of the 8-warp kernel named outright. A name that
    is not a form is a clear error."""
    libs, model = emulated
    prompt = serve_check.prompt_text(random.Random(9), 60)

    def generate() -> subprocess.CompletedProcess:
        return subprocess.run(
            [kura_bin(), "generate", "--model", model, "--prompt", prompt, "--max-tokens", "6", "--ignore-eos",
             "--device", "cuda", "--json"],
            capture_output=True, text=True, timeout=600)

    runs = {}
    for kernels in ["default", "narrow", ""]:
        on_emulated_device(monkeypatch, libs, kernels)
        if not kernels:
            monkeypatch.delenv("KURA_GPU_KERNELS")
        out = generate()
        assert out.returncode == 0, out.stderr[-3000:]
        runs[kernels] = (json.loads(out.stdout), out.stderr)
    report, log = runs["default"]
    assert report["prompt_tokens"] >= 64, report
    assert "prefill attention: narrow, decode: default (KURA_GPU_KERNELS=default)" in log, log[-3000:]
    assert "prefill attention: narrow, decode: default (KURA_GPU_KERNELS)" in runs["narrow"][1], runs["narrow"][1]
    for kernels in ["narrow", ""]:
        got, log = runs[kernels]
        assert got["text"] == report["text"] and got["generated_tokens"] == report["generated_tokens"], (got, report)
        if kernels == "narrow":
            continue
        assert not serve_check.check_prefill_kernel(log), log[-3000:]
        prefill = [line.split("prefill attention: ", 1)[1] for line in log.splitlines() if "prefill attention: " in line]
        decode = [line.split("decode: ", 1)[1] for line in log.splitlines() if " decode: " in line]
        assert len(prefill) == 1 and len(decode) == 1, log[-3000:]
        # "<chosen> (a <n>-token prompt, 2 layers: narrow <ms> ms, wide <ms> ms, ...)"
        assert "-token prompt, 2 layers: narrow " in prefill[0], prefill[0]
        for name in serve_check.FORMS:
            assert f" {name} " in prefill[0], prefill[0]
        # "<chosen> (batch-1 steps over <n> tokens: default <ms> ms, gemv_ahead <ms> ms, ...)"
        options = ["default", "gemv_ahead", "gemv_batched", "split_prefetch", "gemv_ahead+split_prefetch",
                   "gemv_batched+split_prefetch"]
        assert decode[0].split(" ", 1)[0] in options, decode[0]
        for name in options:
            assert f" {name} " in decode[0], decode[0]
        assert "other bits" not in prefill[0] + decode[0], (prefill, decode)

    on_emulated_device(monkeypatch, libs, "widest")
    out = generate()
    assert out.returncode != 0
    assert "KURA_GPU_KERNELS=widest: give auto, default or a prefill attention kernel" in out.stderr, \
        out.stderr[-3000:]
