"""Prints Kura's GPU figures beside HF transformers' from the JSON lines of gpu-bench and hf_peer.py:
`table.py KURA.jsonl HF.jsonl`."""

import json
import sys


def load(path):
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            if r.get("what") in ("decode", "prefill", "cached_ttft"):
                rows.append(r)
    return rows


def key(r):
    return (r["what"], r.get("tokens"), r.get("batch"), r.get("prompt"))


def num(r, name):
    """A figure of `r`, NaN where it was not measured (null) or is absent."""
    v = r.get(name)
    return float("nan") if v is None else v


if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
    sys.exit(f"usage: {sys.argv[0]} KURA.jsonl HF.jsonl (the JSON lines of gpu-bench and hf_peer.py)")
kura, hf = load(sys.argv[1]), load(sys.argv[2])
peer = {key(r): r for r in hf}
print(f"{'figure':<44}{'Kura':>12}{'HF':>12}{'Kura / HF':>12}")
for r in kura:
    p = peer.get(key(r), {})
    if r["what"] == "decode":
        graphs = {True: ", graphs", False: ", no graphs"}.get(r.get("graphs"), "")
        graphs += {True: " + dependent launch", False: ""}.get(r.get("dependent_launch"), "")
        parts = (r.get("fused_attention"), r.get("fused_norm"))
        if parts == (True, False):
            graphs += ", fused attention only"
        elif parts == (False, True):
            graphs += ", fused norms only"
        else:
            graphs += {True: ", fused kernels", False: ", separate kernels"}.get(r.get("fused"), "")
        # ("gemv_ahead": true in runs before the batched form)
        gemv = r.get("gemv", "gemv_ahead" if r.get("gemv_ahead") else "gemv")
        graphs += {"gemv_ahead": ", L2 window", "gemv_batched": ", W staged by cp.async"}.get(gemv, "")
        if r.get("split_prefetch"):
            graphs += ", K/V prefetch"
        name, unit = f"decode batch {r['batch']}, {r['context']} context{graphs} (tok/s)", "tokens_per_s"
        ratio = r[unit] / p[unit] if unit in p else None
    elif r["what"] == "prefill":
        kernel = f", {r['kernel']}" if "kernel" in r else ""
        name, unit = f"prefill TTFT {r['tokens']} tokens{kernel} (ms)", "ms"
        ratio = p[unit] / r[unit] if unit in p else None
    else:
        name, unit = f"TTFT {r['prompt']} tokens, {r['cached']} cached (ms)", "ms"
        ratio = p[unit] / r[unit] if unit in p else None
    hv = f"{p[unit]:.1f}" if unit in p else "-"
    rt = f"{ratio:.2f}x" if ratio else "-"
    print(f"{name:<44}{r[unit]:>12.1f}{hv:>12}{rt:>12}")
    if "fraction_of_bound" in r and r["fraction_of_bound"] is None:
        print("  HBM bound not known: the copy bandwidth was not measured")
    elif "fraction_of_bound" in r:
        sheet = (f"; {r['fraction_of_datasheet_bound']:.1%} of the {r['card']}'s datasheet {r['datasheet_tbs']} TB/s"
                 if r.get("datasheet_tbs") else f"; no datasheet bandwidth known for {r.get('card', 'this card')}")
        print(f"  {r['fraction_of_bound']:.1%} of the HBM bound ({r['hbm_bound_tokens_per_s']:.0f} tok/s at the measured "
              f"{r['copy_bandwidth_gbs']:.0f} GB/s){sheet}")
print("(Kura / HF: speed-up, above 1 means Kura is faster)")
l2 = [json.loads(l) for l in open(sys.argv[1]) if '"l2_revisit"' in l and l.startswith("{")]
if l2:
    print()
    print("A revisited prompt whose KV is only in the host tier (L2), then `new` tokens prefilled; from L2:")
    print("a synchronous copy a block, then the step; ordered: loads layer by layer, the step issued at once")
    print("(copies of at least 128 KiB: a block's layers grouped; per layer: a copy a layer of a block):")
    print(f"{'tokens':>8}{'new':>6}{'KV':>6}{'host':>10}{'copy ms':>10}{'GB/s':>8}{'from L2':>10}{'ordered':>10}"
          f"{'per layer':>10}{'in HBM':>10}{'cold':>10}{'L2/(copy+HBM)':>15}{'ord/(copy+HBM)':>16}{'ord/max':>9}{'cold/best':>10}")
    for r in l2:
        print(f"{r['tokens']:>8}{r.get('new', 16):>6}{r.get('kv', 'bf16'):>6}{r['host']:>10}{r['copy_ms']:>10.2f}"
              f"{r['copy_gbs']:>8.1f}{r['ttft_l2_ms']:>10.2f}{num(r, 'ttft_l2_ordered_ms'):>10.2f}"
              f"{num(r, 'ttft_l2_ordered_per_layer_ms'):>10.2f}"
              f"{r['ttft_device_ms']:>10.2f}{r['ttft_cold_ms']:>10.1f}{r['l2_over_copy_plus_device']:>15.3f}"
              f"{num(r, 'ordered_over_copy_plus_device'):>16.3f}"
              f"{num(r, 'ordered_over_max_copy_device'):>9.3f}{r['speedup_over_cold']:>9.1f}x")
    at = {(r.get("kv", "bf16"), r["host"]): r for r in l2 if r["tokens"] == 16384}
    if ("fp8", "pinned") in at and ("bf16", "pinned") in at:
        print(f"fp8 against bf16 KV, 16,384 tokens from L2: "
              f"{at[('bf16', 'pinned')]['ttft_l2_ms'] / at[('fp8', 'pinned')]['ttft_l2_ms']:.2f}x faster "
              f"(ordered loads: {num(at[('bf16', 'pinned')], 'ttft_l2_ordered_ms') / num(at[('fp8', 'pinned')], 'ttft_l2_ordered_ms'):.2f}x)")
drafts = [json.loads(l) for l in open(sys.argv[1]) if '"draft_check"' in l and l.startswith("{")]
if drafts:
    print()
    print(f"Checking drafts (speculative decoding): a step of each sequence's last token and k draft tokens at "
          f"{drafts[0]['context']} tokens of context, greedy at every position, against a plain decode step:")
    print(f"{'batch':>6}{'k':>4}{'ms/step':>10}{'plain ms':>10}{'x plain':>9}")
    for r in drafts:
        print(f"{r['batch']:>6}{r['draft_tokens']:>4}{r['ms_per_step']:>10.3f}{r['plain_ms_per_step']:>10.3f}"
              f"{r['over_plain']:>8.2f}x")
itl = [json.loads(l) for l in open(sys.argv[1]) if '"itl_while_loading"' in l and l.startswith("{")]
for r in itl:
    print()
    print(f"Batch-{r['batch']} decode steps while a {r['prefix_tokens']:,}-token prefix loads from the host tier "
          f"({r['copy_ms']:.1f} ms of copies): {r['step_ms_alone']:.2f} ms alone, {r['step_ms_beside_loads']:.2f} ms "
          f"beside the copies (max {r['step_ms_beside_loads_max']:.2f}), {r['step_ms_with_loading_request']:.2f} ms "
          f"for the step that holds the loading request too")
for r in [json.loads(l) for l in open(sys.argv[1]) if '"itl_after_swap_out"' in l and l.startswith("{")]:
    print()
    print(f"Batch-{r['batch']} decode steps right after a {r['swapped_tokens']:,}-token sequence is swapped out to "
          f"the host tier ({r['store_ms']:.1f} ms of copies): {r['step_ms_alone']:.2f} ms alone, "
          f"{r['step_ms_after_stores']:.2f} ms right after the stores start, {r['step_ms_reusing_first_stored']:.2f} ms "
          f"for the step that also writes the block stored first")
    if "load_ms_alone" in r:
        print(f"Both directions at once: {r['duplex_blocks']} blocks loaded in {r['load_ms_alone']:.1f} ms alone, "
              f"{r['load_ms_beside_stores']:.1f} ms right after the stores of {r['duplex_blocks']} others start "
              f"(those stores alone: {r['duplex_store_ms']:.1f} ms; one stream for both would take about the sum)")
for r in [json.loads(l) for l in open(sys.argv[1]) if '"tuning"' in l and l.startswith("{")]:
    print()
    def timed(items, key):
        return ", ".join(f"{f[key]} {f['ms']:.3f} ms" + ("" if f["same_bits"] else " (other bits)") for f in items)
    print(f"Kernels a server would choose here (a {r['tokens']:,}-token prompt): prefill {r['prefill_chosen']} "
          f"({r['layers']} layers: {timed(r['prefill'], 'kernel')}); decode {r['decode_chosen']} "
          f"(a batch-1 step: {timed(r['decode'], 'options')})")
prof = [json.loads(l) for l in open(sys.argv[1]) if '"profile"' in l and l.startswith("{")]
prefill = [r for r in prof if r["step"].startswith("prefill_long")]
if prefill:
    print()
    print("Where a long prefill's attention time goes (launch by launch; the probes are the 8-warp kernel with a")
    print("part left out: noload = no copies after the first key tile, nosoftmax = no mask, maxima, exponentials")
    print("or rescaling, loadonly = the copies and barriers alone, mmaonly = the two products alone):")
    full = None
    for r in prefill:
        attn = sum(k["ms"] for k in r["top"] if k["kernel"].startswith("attn_prefill"))
        name = r["step"][len("prefill_long"):].lstrip("_") or "narrow"
        if name == "narrow":
            full = attn
        share = f"{attn / full:>7.2f}x the 8-warp kernel" if full else ""
        print(f"  {name:<16}{r['tokens']:>8} tokens: attention {attn:>9.1f} ms of the step's {r['total_ms']:>9.1f} ms{share}")
