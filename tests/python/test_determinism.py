"""Cold = cached, bit for bit: a token's log-probabilities do not depend on how many tokens its step computed.

For every weights format (native, bf16, f32) on every kernel path this CPU has (AVX-512, AVX2, portable;
`KURA_ISA` narrows the dispatch so that one machine runs them all), one server computes the same prompts:
- cold, in one step (prompts shorter than a block and longer than one), or in chunks of the step budget
  (a prompt longer than an attention segment of 1,024 positions, so its tokens read two segments; on the
  vector paths, where it takes seconds rather than minutes);
- again, with all but its last block served from the prefix cache;
- and the tokens that were decoded alone after it are prefilled as part of a longer prompt.
Every generated token's top log-probabilities must be the same bits on every way. The server logs which
kernel paths it runs; the test checks that the path it asked for is the one that ran, and fails where this
CPU has a path's instructions but the path was not compared.
"""

import os
import pathlib

import pytest

from conftest import KuraServer, long_text

WEIGHTS = ("native", "bf16", "f32")
# The step budget: a prompt longer than it is prefilled in chunks.
BUDGET = 256
GENERATED = 3
TOP = 5


def cpu_flags() -> set[str]:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    raise AssertionError("/proc/cpuinfo has no flags line")


def kernel_paths() -> list[tuple[str, str | None]]:
    """(the paths the server logs, as `isa=…` and `quant=…`, the KURA_ISA that selects them) for each
    path this CPU has. On a CPU with AMX the quantized products' prefill runs on its tiles, and
    `KURA_ISA=avx512` selects the AVX-512 VNNI kernel instead."""
    flags = cpu_flags()
    paths = [("isa=scalar", "scalar")]
    if {"avx2", "fma"} <= flags:
        paths.append(("isa=avx2+fma", "avx2"))
    if "avx512f" in flags:
        if {"amx_tile", "amx_int8", "avx512_vnni", "avx512bw"} <= flags:
            paths.append(("isa=avx512 quant=Amx", None))
            paths.append(("isa=avx512 quant=Vnni", "avx512"))
        else:
            paths.append(("isa=avx512", None))
    return paths


def path_id(logged: str) -> str:
    return "-".join(part.split("=")[1] for part in logged.split())


def logprobs(server: KuraServer, prompt: list[int], max_tokens: int = GENERATED):
    """The generated tokens' ids, each one's top log-probabilities as the server wrote them, and how many
    prompt tokens were cached."""
    r = server.client().completions.create(
        model=server.model(), prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=TOP,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    assert len(ids) == max_tokens == len(choice.logprobs.top_logprobs)
    return ids, choice.logprobs.top_logprobs, r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("isa,kura_isa", kernel_paths(), ids=[path_id(name) for name, _ in kernel_paths()])
def test_cold_cached_chunked_and_decoded_give_the_same_bits(isa, kura_isa, weights):
    env = {k: v for k, v in os.environ.items() if k != "KURA_ISA"}
    if kura_isa:
        env["KURA_ISA"] = kura_isa
    s = KuraServer("--weights-dtype", weights, "--kv-cache-memory", "128MiB",
                   "--max-num-batched-tokens", str(BUDGET), "--threads", "2", env=env)
    try:
        loaded = [line for line in s.log().splitlines() if "model loaded" in line]
        ran = loaded[0] + " " if loaded else ""
        assert all(f"{part} " in ran for part in isa.split()), f"asked for {isa}:\n{s.log()[-2000:]}"
        # Shorter than a block, longer than one, and longer than an attention segment (chunked by BUDGET).
        # The portable path's matrix kernels are too slow for a prompt of a thousand tokens in every run
        # of the suite; the attention that reads two segments is the same portable loop on the AVX2 path.
        prompts = {
            "short": "Name three colours.",
            "blocks": "Summarise this list of words: " + long_text(25, seed=1),
        }
        if isa != "isa=scalar":
            prompts["segment"] = "Count the words of this text. " + long_text(1060, seed=2)
        for what, text in prompts.items():
            prompt = s.tokenize(text)
            cold_tokens, cold, cached_tokens = logprobs(s, prompt)
            assert cached_tokens == 0, f"{what}: not cold"
            if what == "segment":
                assert len(prompt) > 1024, len(prompt)
            if what == "short":
                assert len(prompt) < 16, len(prompt)
            # Again: the prompt's whole blocks come from the cache (at most one is recomputed).
            again_tokens, again, cached_tokens = logprobs(s, prompt)
            assert cached_tokens >= (len(prompt) - 1) // 16 * 16 - 16 > 0 or what == "short", cached_tokens
            assert (again_tokens, again) == (cold_tokens, cold), f"{isa} {weights} {what}: cached ≠ cold"
            # The tokens decoded alone, prefilled as part of the prompt: the next tokens' log-probabilities
            # were computed in a decode step of one token the first time, and in a prefill now.
            for k in (1, 2):
                longer_tokens, longer, _ = logprobs(s, prompt + cold_tokens[:k], max_tokens=GENERATED - k)
                assert (longer_tokens, longer) == (cold_tokens[k:], cold[k:]), (
                    f"{isa} {weights} {what}: token {k} prefilled ≠ decoded")
    finally:
        s.stop()
