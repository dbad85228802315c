"""A `kura serve`'s /metrics for the bench scripts, which import it (they run as `python3 bench/X.py`,
so this folder is on their path): the samples by name, and the engine's mean step time between two
readings."""

import httpx


def metrics(url: str) -> dict[str, float]:
    """Every sample of `url`'s /metrics, by its name with labels."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def mean_step_ms(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """The engine's steps between two readings, and their mean time in ms (inside the executor and
    outside it)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    steps = d["kura:engine_steps_total"]
    step_s = d["kura:engine_forward_seconds_total"] + d["kura:engine_step_other_seconds_total"]
    return steps, 1000 * step_s / steps
