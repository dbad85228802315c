#!/usr/bin/env python3
"""What the console costs the server: `kura bench shared-prefix` runs against one `kura serve`, with no
console open, with a client polling `/v1/kv/summary` twice a second as the page does, and (with
`--chromium`) with the page itself open in headless Chromium, interleaved (each run with prompts of its
own, the order of the modes rotating from round to round), `--runs` rounds. Reports the
engine's mean step time from /metrics per mode (median of the rounds) and its ratio to the run without.

    python3 bench/console_cost.py --url http://127.0.0.1:8000 --kura target/release/kura \
        [--runs 3] [--chromium /usr/bin/chromium --chromedriver /usr/bin/chromedriver] [--server-pid PID]

With `--server-pid`, it also reports the server's CPU time per engine step (all its threads, from
/proc/PID/task/*/schedstat): time on a CPU, which other processes' turns on the cores do not lengthen, so
it resolves a smaller difference than the step's wall time on a shared machine. Run the server and this
script on different CPUs (`taskset`) to keep the browser off the server's cores.

The page also costs the machine its browser (layout, canvas): on a machine whose cores the server uses,
the `page` mode counts that too, and `summary` is the server's own share.
"""

import argparse
import os
import statistics
import subprocess
import tempfile
import threading
import time

import httpx

from server_metrics import mean_step_ms, metrics


def server_cpu_ns(pid: int | None) -> int:
    """Nanoseconds the server's threads have run on a CPU (0 without a pid)."""
    if pid is None:
        return 0
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return total


def bench(kura: str, url: str, seed: int, pid: int | None = None) -> dict[str, float]:
    before, cpu0 = metrics(url), server_cpu_ns(pid)
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([kura, "bench", "shared-prefix", "--url", url, "--groups", "4", "--users-per-group", "8",
                        "--system-tokens", "512", "--question-tokens", "32", "--output-tokens", "64",
                        "--concurrency", "8", "--seed", str(seed), "--out", out],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after, cpu1 = metrics(url), server_cpu_ns(pid)
    steps, step_ms = mean_step_ms(before, after)
    return {"step_ms": step_ms, "steps": steps, "cpu_ms": (cpu1 - cpu0) / 1e6 / steps}


class Poller:
    """GET /v1/kv/summary twice a second, as the page does, until stopped."""

    def __init__(self, url: str):
        self.url, self.stop, self.count = url, threading.Event(), 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        with httpx.Client(timeout=10) as c:
            while not self.stop.wait(0.5):
                c.get(self.url + "/v1/kv/summary").raise_for_status()
                self.count += 1

    def close(self):
        self.stop.set()
        self.thread.join()


class Page:
    """The console open in headless Chromium, until closed."""

    def __init__(self, url: str, chromium: str, chromedriver: str):
        os.environ["SE_OFFLINE"] = "true"
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service

        o = Options()
        o.binary_location = chromium
        for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", f"--user-data-dir={tempfile.mkdtemp()}"):
            o.add_argument(a)
        self.driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=o)
        self.driver.get(url + "/console")
        time.sleep(2)
        self.start = self.driver.execute_script("return window.__updates")
        self.t0 = time.monotonic()

    def close(self):
        n = self.driver.execute_script("return window.__updates") - self.start
        rate = n / (time.monotonic() - self.t0)
        self.driver.quit()
        return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--kura", required=True, help="the kura binary (for `kura bench`)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--chromium")
    p.add_argument("--chromedriver")
    p.add_argument("--server-pid", type=int, help="the server's pid, for its CPU time per step")
    a = p.parse_args()
    modes = ["none", "summary"] + (["page"] if a.chromium else [])
    bench(a.kura, a.url, 0)  # warm-up
    results: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    rates = []
    seed = 0
    for r in range(a.runs):
        # Every run its own prompts (a fresh seed: the same work, none of it cached by another run), and
        # the modes in a rotating order.
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            seed += 1
            extra = Poller(a.url) if mode == "summary" else Page(a.url, a.chromium, a.chromedriver) \
                if mode == "page" else None
            r = bench(a.kura, a.url, seed, a.server_pid)
            results[mode].append(r["step_ms"])
            cpu[mode].append(r["cpu_ms"])
            if mode == "page":
                rates.append(extra.close())
            elif extra:
                extra.close()
    base = statistics.median(results["none"])
    for mode in modes:
        med = statistics.median(results[mode])
        print(f"{mode:8} step {med:.3f} ms (runs {', '.join(f'{x:.3f}' for x in results[mode])})  "
              f"ratio {med / base:.4f}")
    if a.server_pid:
        base = statistics.median(cpu["none"])
        for mode in modes:
            med = statistics.median(cpu[mode])
            print(f"{mode:8} server CPU {med:.3f} ms per step (runs {', '.join(f'{x:.3f}' for x in cpu[mode])})  "
                  f"ratio {med / base:.4f}")
    if rates:
        print(f"page updates per second: {', '.join(f'{x:.2f}' for x in rates)}")


if __name__ == "__main__":
    main()
