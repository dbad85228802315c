"""The console (`kura serve --console`, on by default on loopback) in a real browser: Debian's Chromium,
headless, driven through ChromeDriver by selenium, against a real `kura serve` on the default model.

The page loads with no JavaScript error and no console error; after a known workload its numbers equal
`/metrics`; it keeps updating; the playground's second turn shows the first turn cached, and a turn the
server refuses or never answers is shown failed and left out of the conversation; a screenshot is not
blank. The summary behind it holds no token text and no tenant identity, and a tenant key sees nothing at
all.
"""

import io
import os
import re
import tempfile

import httpx
import pytest
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from conftest import BLOCK, KuraServer, long_text

SALT = "console-salt-7f3a"
WORD = "zebrafishqq"


@pytest.fixture(scope="module")
def server():
    s = KuraServer("--kv-cache-memory", "64MiB", "--max-model-len", "2048")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    chromium = os.environ.get("KURA_CHROMIUM")
    driver = os.environ.get("KURA_CHROMEDRIVER")
    assert chromium and driver, \
        "KURA_CHROMIUM and KURA_CHROMEDRIVER are not set: scripts/test.sh sets them from scripts/fetch-chromium.sh"
    os.environ["SE_OFFLINE"] = "true"  # selenium must not look for a driver of its own
    profile = tempfile.mkdtemp(prefix="kura-chromium-")
    o = Options()
    o.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,2200"):
        o.add_argument(a)
    o.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    b = webdriver.Chrome(service=Service(executable_path=driver), options=o)
    yield b
    b.quit()


def number(b, element_id: str) -> float:
    return float(b.find_element(By.ID, element_id).text.replace(",", ""))


def open_console(b, server: KuraServer) -> int:
    """Loads the page and waits for two updates past the first; returns the update count then."""
    b.get(server.url + "/console")
    WebDriverWait(b, 30).until(lambda d: d.execute_script("return window.__updates") >= 2)
    return b.execute_script("return window.__updates")


def no_errors(b) -> None:
    assert b.execute_script("return window.__errors") == []
    severe = [e for e in b.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == [], severe


def turns(b) -> list:
    """The playground's turns as the page shows them: class, done mark, the start of the text."""
    return b.execute_script(
        "return Array.from(document.querySelectorAll('#pg-turns .turn'))"
        ".map(t => [t.className, t.dataset.done || '', t.textContent.slice(0, 300)])")


def say(b, server: KuraServer, words: str, n: int):
    """Sends `words` in the playground and returns the n-th finished turn (answered or failed); a turn that
    never finishes fails the test with what the page shows and the server's log."""
    b.find_element(By.ID, "pg-input").send_keys(words)
    b.find_element(By.ID, "pg-send").click()
    finished = "#pg-turns .turn[data-done='1']"
    try:
        WebDriverWait(b, 60).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, finished)) >= n)
    except TimeoutException:
        pytest.fail(f"turn {n} did not finish in 60 s; the page shows {turns(b)!r}; "
                    f"server log:\n{server.log()[-4000:]}")
    return b.find_elements(By.CSS_SELECTOR, finished)[n - 1]


def workload(server: KuraServer) -> None:
    """Three prompts sharing a long prefix under one salt: the second and third hit the first's blocks."""
    c = server.client()
    shared = long_text(300, seed=11) + " " + WORD
    for q in ("one", "two", "three"):
        c.completions.create(model=server.model(), prompt=f"{shared} question {q}", max_tokens=4, temperature=0,
                             extra_body={"cache_salt": SALT})
    server.wait_idle()


def test_the_page_shows_what_metrics_show_and_keeps_updating(server, browser):
    workload(server)
    before = open_console(browser, server)
    m = server.metrics()
    shown = {
        "pool-total": m["kura:kv_cache_blocks_total"],
        "pool-used": m["kura:kv_cache_blocks_used"],
        "pool-cached": m["kura:kv_cache_blocks_cached"],
        "query-tokens": m["kura:prefix_cache_queries_total"],
        "hit-tokens": m["kura:prefix_cache_hits_total"],
        "requests-finished": m['kura:request_success_total{finished_reason="stop"}']
        + m['kura:request_success_total{finished_reason="length"}'],
        "running": m["kura:num_requests_running"],
        "waiting": m["kura:num_requests_waiting"],
    }
    # The server is idle: the next updates show these numbers.
    WebDriverWait(browser, 10).until(lambda d: d.execute_script("return window.__updates") >= before + 2)
    for element_id, want in shown.items():
        assert number(browser, element_id) == want, element_id
    assert m["kura:prefix_cache_hits_total"] > 0
    assert browser.find_element(By.ID, "status").text == "live"
    # The largest cached prefix is the shared one, labelled by an opaque tenant name.
    # Read in one go: the page replaces the table's rows at every update.
    rows = browser.execute_script(
        "return Array.from(document.querySelectorAll('#prefixes tbody tr'))"
        ".map(r => Array.from(r.cells).map(c => c.textContent))")
    assert rows, "no cached prefix listed"
    cells = rows[0]
    assert int(cells[0]) >= 300 // BLOCK and int(cells[3]) >= 2, cells  # blocks, hits of its start
    assert re.fullmatch(r"tenant-[0-9a-f]{6}", cells[-1]), cells
    # Nothing of the prompts or of the salt reaches the page.
    page = browser.page_source
    assert WORD not in page and SALT not in page and "lantern" not in page
    no_errors(browser)
    png = browser.get_screenshot_as_png()
    img = Image.open(io.BytesIO(png)).convert("RGB")
    assert img.size[0] >= 800 and len(img.getcolors(maxcolors=1 << 20) or []) > 20, "the screenshot is blank"


def test_the_playground_shows_the_second_turn_cached(server, browser):
    open_console(browser, server)
    browser.find_element(By.ID, "pg-max").clear()
    browser.find_element(By.ID, "pg-max").send_keys("24")

    def answered(words: str, n: int):
        turn = say(browser, server, words, n)
        assert "assistant" in turn.get_attribute("class").split(), \
            f"turn {n} failed: {turns(browser)!r}; server log:\n{server.log()[-4000:]}"
        return turn

    first = answered("Tell me about rivers and stones and lanterns in a harbor at night. " * 4, 1)
    second = answered("And what about the meadow?", 2)
    p1 = int(first.get_attribute("data-prompt"))
    cached = int(second.get_attribute("data-cached"))
    # The second turn resends the first turn's prompt and answer: every whole block of the first prompt
    # is found cached.
    assert p1 > BLOCK and cached >= (p1 - 1) // BLOCK * BLOCK, (p1, cached)
    assert f"cached {cached} of" in second.text
    assert float(second.get_attribute("data-ttft-ms")) > 0
    no_errors(browser)


def test_a_failed_turn_is_shown_failed_and_left_out_of_the_conversation(browser):
    s = KuraServer("--kv-cache-memory", "64MiB", "--max-model-len", "2048")
    try:
        open_console(browser, s)
        conversation = "return conversation.map(m => m.role + ':' + m.content)"

        # A request the server refuses: the turn says why, and the conversation does not keep it.
        temp = browser.find_element(By.ID, "pg-temp")
        temp.clear()
        temp.send_keys("5")
        refused = say(browser, s, "Refused?", 1)
        assert "error" in refused.get_attribute("class").split(), refused.get_attribute("class")
        assert "HTTP 400" in refused.text and "temperature" in refused.text, refused.text
        assert browser.execute_script(conversation) == []
        temp.clear()
        temp.send_keys("0")
        answered = say(browser, s, "Hello there", 2)
        assert "assistant" in answered.get_attribute("class").split()
        assert [m.split(":")[0] for m in browser.execute_script(conversation)] == ["user", "assistant"]
        # The server dies: the next turn fails with the browser's network error, the page stays usable.
        s.proc.kill()
        s.proc.wait()
        lost = say(browser, s, "Are you there?", 3)
        assert "error" in lost.get_attribute("class").split(), lost.get_attribute("class")
        assert "Failed to fetch" in lost.text, lost.text
        assert [m.split(":")[0] for m in browser.execute_script(conversation)] == ["user", "assistant"]
        assert browser.execute_script("return window.__errors") == []
    finally:
        s.stop()


def test_the_summary_holds_no_text_and_no_tenant_identity_and_a_tenant_key_sees_nothing():
    tenant, operator = "tenant-key-9c1e", "operator-key-51aa"
    s = KuraServer("--kv-cache-memory", "64MiB", "--api-key", tenant, "--admin-api-key", operator, api_key=tenant)
    try:
        c = s.client()
        c.completions.create(model=s.model(), prompt=long_text(200, seed=3) + " " + WORD, max_tokens=2,
                             temperature=0)
        s.wait_idle()
        base = s.url
        for path in ("/console", "/console/console.js", "/v1/kv/summary"):
            assert httpx.get(base + path).status_code == 401, path
            r = httpx.get(base + path, headers={"Authorization": f"Bearer {tenant}"})
            assert r.status_code == 403, path
            assert WORD not in r.text and "<html" not in r.text
        r = httpx.get(base + "/v1/kv/summary", headers={"Authorization": f"Bearer {operator}"})
        assert r.status_code == 200
        summary = r.json()
        assert summary["prefixes"]["top"], summary
        body = r.text
        # No token text, no key, no tenant name: only opaque labels.
        assert WORD not in body and tenant not in body and operator not in body
        assert all(re.fullmatch(r"tenant-[0-9a-f]{6}", p["tenant"]) for p in summary["prefixes"]["top"])
        assert "tokens" not in {k for p in summary["prefixes"]["top"] for k, v in p.items() if isinstance(v, list)}
    finally:
        s.stop()
    # Tenant keys and no operator key: there is no console at all.
    s = KuraServer("--kv-cache-memory", "64MiB", "--api-key", tenant, api_key=tenant)
    try:
        for path in ("/console", "/v1/kv/summary"):
            r = httpx.get(s.url + path, headers={"Authorization": f"Bearer {tenant}"})
            assert r.status_code == 404, path
    finally:
        s.stop()


def test_asking_for_the_console_with_tenant_keys_and_no_operator_key_is_refused():
    with pytest.raises(RuntimeError, match="operator key"):
        KuraServer("--api-key", "k", "--console")
