#!/usr/bin/env python3
"""Golden vectors for Kura's dequantization of the ggml block formats that have no hand-written test:
Q5_0, Q5_1 and the K-quants Q2_K … Q6_K.

For each type: two blocks of seeded random bytes (with finite f16 scales written in place), and their values
as the reference implementation in `gguf` (the Python package of llama.cpp) dequantizes them. Writes
crates/kura-model/tests/data/golden/quants.json.

    python scripts/golden/make_quants.py        (needs: pip install gguf numpy)
"""

import json
import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

OUT = pathlib.Path(__file__).resolve().parents[2] / "crates/kura-model/tests/data/golden/quants.json"

# Byte offsets of the f16 super-block scales (d, and dmin where the type has one) in each block.
SCALES = {
    T.Q5_0: [(0, 0.05)],
    T.Q5_1: [(0, 0.05), (2, 0.5)],
    T.Q2_K: [(80, 0.05), (82, 0.02)],
    T.Q3_K: [(108, 0.05)],
    T.Q4_K: [(0, 0.05), (2, 0.02)],
    T.Q5_K: [(0, 0.05), (2, 0.02)],
    T.Q6_K: [(208, 0.05)],
}


def main():
    rng = np.random.default_rng(0)
    out = {}
    for qtype, scales in SCALES.items():
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        blocks = 2 if block_bytes > 100 else 8
        raw = rng.integers(0, 256, size=blocks * block_bytes, dtype=np.uint8)
        for b in range(blocks):
            for offset, magnitude in scales:
                value = np.float16(rng.uniform(-magnitude, magnitude))
                at = b * block_bytes + offset
                raw[at : at + 2] = np.frombuffer(value.tobytes(), dtype=np.uint8)
        values = dequantize(raw, qtype).astype(np.float32).reshape(-1)
        out[qtype.name] = {
            "id": int(qtype.value),
            "bytes": raw.tobytes().hex(),
            "values": [float(v) for v in values],
        }
    OUT.write_text(json.dumps(out))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
