"""Starts the real `kura serve` on the default model for the tests, and helpers to read its /metrics.

The binary is $KURA_BIN (scripts/test.sh sets it), else target/release/kura, else target/debug/kura; the
model is $KURA_MODEL, else the default path of scripts/fetch-model.sh.
"""

import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import time

import httpx
import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = 16


def kura_bin() -> str:
    if os.environ.get("KURA_BIN"):
        return os.environ["KURA_BIN"]
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / "kura"
        if p.exists():
            return str(p)
    # A missing prerequisite fails the suite: a skipped suite would read as a green one.
    pytest.fail("no kura binary: build it with `cargo build --release -p kura` or set KURA_BIN", pytrace=False)


def model_path() -> str:
    p = os.environ.get("KURA_MODEL") or os.path.join(
        os.environ.get("KURA_CACHE_DIR")
        or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kura"),
        "models",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    )
    if not os.path.exists(p):
        pytest.fail(f"model {p} not found: run scripts/fetch-model.sh", pytrace=False)
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus(url: str) -> dict[str, float]:
    """Unlabelled and labelled samples of the /metrics at `url`, keyed by the sample's full name."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def closed_by_peer(conns: list[socket.socket], timeout: float) -> int:
    """How many of `conns` the server has closed (reading gives end of file within `timeout`)."""
    closed = 0
    for c in conns:
        c.settimeout(timeout)
        try:
            if c.recv(1) == b"":
                closed += 1
        except (socket.timeout, ConnectionResetError):
            pass
    return closed


def wait_healthy(proc: subprocess.Popen, url: str, what: str, log, timeout: float) -> bool:
    """Waits until `url`/health answers 200; raises if the process exits first; False on timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # poll interval
    return False


class KuraServer:
    """One `kura serve` process on a free port (with `env` as its whole environment, if given)."""

    def __init__(self, *args: str, api_key: str = "unused", model: str | None = None, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_file = tempfile.NamedTemporaryFile(prefix="kura-serve-", suffix=".log", delete=False)
        cmd = [kura_bin(), "serve", "--model", model or model_path(), "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env=env)
        if wait_healthy(self.proc, self.url, "kura serve", self.log, 180):
            return
        self.stop()
        raise RuntimeError(f"kura serve did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return pathlib.Path(self.log_file.name).read_text(errors="replace")

    def client(self, api_key: str | None = None, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or self.api_key, max_retries=0, **kw)

    def async_client(self, api_key: str | None = None, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key or self.api_key, max_retries=0, **kw)

    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", headers=self.headers()).json()["data"][0]["id"]

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}

    def tokenize(self, prompt: str) -> list[int]:
        r = httpx.post(self.url + "/tokenize", json={"prompt": prompt}, headers=self.headers())
        r.raise_for_status()
        return r.json()["tokens"]

    def metrics(self) -> dict[str, float]:
        """Unlabelled and labelled samples of /metrics, keyed by the sample's full name."""
        return prometheus(self.url)

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Waits until no request runs or waits and no block is referenced; returns the metrics then."""
        deadline = time.time() + timeout
        m = self.metrics()
        while time.time() < deadline:
            m = self.metrics()
            if (
                m["kura:num_requests_running"] == 0
                and m["kura:num_requests_waiting"] == 0
                and m["kura:kv_cache_blocks_used"] == 0
            ):
                return m
            time.sleep(0.1)  # poll interval
        return m

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# Tests that compare outputs across cache paths (cold vs cached, stream vs not, seeds) run with f32
# weights, the format whose kernels differ most between CPUs (packed on AVX-512, row-major elsewhere).
# Every weights format computes a position the same way whatever the step's batch (test_determinism.py
# checks each format on each kernel path).
EXACT = ("--weights-dtype", "f32")


@pytest.fixture(scope="module")
def server():
    s = KuraServer("--kv-cache-memory", "256MiB", *EXACT)
    yield s
    s.stop()


def long_text(words: int, seed: int = 0) -> str:
    """Deterministic filler text of about `words` words (a few tokens each)."""
    vocab = ["river", "stone", "lantern", "harbor", "meadow", "copper", "willow", "signal", "orchard", "canyon",
             "violet", "engine", "mirror", "thunder", "saddle", "pepper", "glacier", "velvet", "anchor", "summit"]
    return " ".join(vocab[(i * 7 + seed * 13 + (i * i) % 17) % len(vocab)] for i in range(words))
