"""The live page at / in a real browser: headless Chromium (Debian's chromium and
chromium-driver) driven by selenium submits a prompt, waits for the streamed text, and
finds tokens marked as accepted draft proposals and as the target's corrections; it
keeps pace with a long stream, Stop ends the decoding, an error clears the statistics,
a phone-wide window does not scroll sideways, token backgrounds hide no glyph.
The screenshot goes to the test's folder; SPEL_SCREENSHOT=PATH also saves it there
(the README's docs/img/server_page.png is made that way)."""
import os
import shutil
import urllib.request
from pathlib import Path

import pytest

import spel_mlx  # noqa: F401
from conftest import require_or_skip, served_model_id

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
PROMPT = "It is a truth universally acknowledged, that"
KEY = "page-key"
JS = Path(__file__).with_name("page_checks.js").read_text()


def _missing(browser: bool):
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
        if browser:
            import selenium  # noqa: F401
    except ImportError as e:
        return f"the page test needs the server and dev extras ({e}): pip install -e '.[dev,server]'"
    if browser and not (CHROMIUM and DRIVER):
        return "chromium and chromedriver not installed (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_or_skip(_missing(False) is None, _missing(False), env="SPEL_REQUIRE_SERVER")
    from bench.server_load import LiveServer
    srv = LiveServer("--api-key", KEY, log_dir=tmp_path_factory.mktemp("page"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory):
    require_or_skip(_missing(True) is None, _missing(True), env="SPEL_REQUIRE_SERVER")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1200,900", f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    yield driver
    driver.quit()


def _by(name):
    from selenium.webdriver.common.by import By
    return getattr(By, name)


def _wait(browser, cond, timeout=60):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(cond)


def _open(browser, server, key=KEY):
    browser.get(server.url + "/")
    el = browser.find_element(_by("ID"), "api-key")
    el.send_keys(key + "\t")                                     # tab: the change event asks /v1/models
    if key == KEY:
        _wait(browser, lambda d: d.find_element(_by("ID"), "model").text == served_model_id(), 30)


def _fill(browser, **fields):
    for field, value in fields.items():
        el = browser.find_element(_by("ID"), field.replace("_", "-"))
        el.clear()
        el.send_keys(str(value))


def _generate(browser, timeout=120):
    browser.find_element(_by("ID"), "generate").click()
    status = browser.find_element(_by("ID"), "status")
    _wait(browser, lambda d: status.get_attribute("data-state") in ("done", "error"), timeout)
    return status


def _check(browser, name, *args):
    """One of page_checks.js's functions, run in the page (async: it calls back)."""
    return browser.execute_async_script(f"{JS}\nreturn checks.{name}(...arguments);", *args)


def test_page_is_all_local(server):
    html = urllib.request.urlopen(server.url + "/").read().decode()
    assert "/static/page.js" in html and "/static/page.css" in html
    assert "http://" not in html and "https://" not in html      # no external scripts or fonts
    for name in ("page.js", "page.css"):
        with urllib.request.urlopen(f"{server.url}/static/{name}") as r:
            body = r.read().decode()
            assert r.status == 200 and "https://" not in body and "@import" not in body


def test_page_streams_marked_tokens(server, browser, tmp_path):
    _open(browser, server)
    _fill(browser, prompt=PROMPT, max_tokens=120, temperature=0, seed=1)
    status = _generate(browser)
    assert status.get_attribute("data-state") == "done", status.text
    assert status.text == "done: length, 120 tokens"
    draft = browser.find_elements(_by("CSS_SELECTOR"), "#output .tok.draft")
    target = browser.find_elements(_by("CSS_SELECTOR"), "#output .tok.target")
    assert len(draft) + len(target) == 120 and draft and target
    look = [{p: e.value_of_css_property(p) for p in ("background-color", "text-decoration-line")}
            for e in (draft[0], target[0])]
    assert look[0]["background-color"] != look[1]["background-color"]
    # a second cue beside hue: the target's tokens are underlined, the draft's are not
    assert (look[0]["text-decoration-line"], look[1]["text-decoration-line"]) == ("none", "underline")
    assert browser.find_element(_by("ID"), "output").text.strip()
    assert int(browser.find_element(_by("ID"), "rounds").text) == len(target)   # one target token per round
    assert int(browser.find_element(_by("ID"), "tokens").text) == 120
    assert float(browser.find_element(_by("ID"), "alpha").text) > 0
    assert float(browser.find_element(_by("ID"), "tok-s").text) > 0
    bars = {c: browser.find_elements(_by("CSS_SELECTOR"), f"#chart rect.{c}") for c in "dt"}
    assert len(bars["t"]) == len(target) and bars["d"]
    shot = tmp_path / "server_page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if os.environ.get("SPEL_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["SPEL_SCREENSHOT"])


def test_page_is_readable(server, browser):
    """The prompt box has a label; the echoed prompt has a contrast of at least 4.5:1
    (WCAG AA); at 390 px (a phone) nothing scrolls sideways."""
    _open(browser, server)
    labels = browser.find_elements(_by("CSS_SELECTOR"), "label[for=prompt]")
    assert labels and labels[0].text.strip().lower() == "prompt"
    _fill(browser, prompt=PROMPT, max_tokens=4, temperature=0)
    assert _generate(browser).get_attribute("data-state") == "done"
    assert _check(browser, "contrast", ".prompt-echo") >= 4.5
    try:
        browser.set_window_size(390, 844)
        _wait(browser, lambda d: d.execute_script("return window.innerWidth") <= 390, 10)
        sizes = browser.execute_script("const e = document.documentElement; return [e.scrollWidth, e.clientWidth]")
        assert sizes[0] <= sizes[1], f"scrolls sideways at 390 px: content {sizes[0]} px, view {sizes[1]} px"
    finally:
        browser.set_window_size(1200, 900)


def test_token_backgrounds_hide_no_glyph(server, browser):
    """Glyphs reaching past their token ("Mr." with "." a token of its own) keep their
    ink: a line of marked tokens is nowhere lighter than the same line unmarked, where a
    background painted over the "r" would be.  Negative control: opaque backgrounds
    (the page's before) do hide ink."""
    _open(browser, server)
    words = ["M", "r", ".", " D", "ar", "cy", " of", "f", ".", " fry", "j", "r", "."]

    def lost(css):
        browser.get(server.url + "/")
        rects = _check(browser, "twoLines", words, css)
        return _check(browser, "inkLost", browser.get_screenshot_as_base64(), *rects)

    assert lost(None) == 0
    assert lost(".tok.draft{background:#d7f0d2}.tok.target{background:#ffd9a8}") > 0


def test_page_keeps_pace_with_a_long_stream(server, browser):
    """2,000 tokens: from Generate to the last token on the page takes at most 20% more
    than the server's time for the request (its wait and decoding)."""
    _open(browser, server)
    _fill(browser, prompt=PROMPT, max_tokens=2000, temperature=0, seed=1)
    _check(browser, "timeRun")
    assert _generate(browser).text == "done: length, 2000 tokens"
    page_s = browser.execute_script("return (window.runDone - window.runStart) / 1000")
    rec = _last(server, lambda r: r.get("tokens") == 2000 and r["status"] == "completed")
    server_s = rec["queued_s"] + rec["decode_s"]
    assert len(browser.find_elements(_by("CSS_SELECTOR"), "#output .tok")) == 2000
    assert page_s <= 1.2 * server_s, f"the page took {page_s:.2f} s, the server {server_s:.2f} s"


def test_stop_ends_decoding(server, browser):
    """Stop during a 4,000-token stream: the server stops after at most a second's worth
    of tokens (at its own speed) beyond what the page showed when Stop was clicked."""
    _open(browser, server)
    _fill(browser, prompt=PROMPT, max_tokens=4000, temperature=0.7, seed=3)
    browser.find_element(_by("ID"), "generate").click()
    shown = browser.find_element(_by("ID"), "tokens")
    _wait(browser, lambda d: shown.text.isdigit() and int(shown.text) >= 800)   # well into the stream
    # read what the page shows and click Stop in one step in the page (no WebDriver round trip between)
    at_click = browser.execute_script("const n = +document.getElementById('tokens').textContent;"
                                      "document.getElementById('stop').click(); return n;")
    status = browser.find_element(_by("ID"), "status")
    _wait(browser, lambda d: status.get_attribute("data-state") == "done")
    assert status.text == "stopped"
    _wait(browser, lambda d: not server.health()["busy"], 30)
    rec = _last(server, lambda r: r["status"] == "cancelled")
    assert rec["reason"] == "client disconnected" and rec["tokens"] < 4000
    assert rec["tokens"] - at_click <= rec["tok_s"] * 1.0, (rec, at_click)


def test_page_clears_statistics_after_an_error(server, browser):
    _open(browser, server)
    _fill(browser, prompt=PROMPT, max_tokens=8, temperature=0)
    assert _generate(browser).get_attribute("data-state") == "done"
    assert browser.find_element(_by("ID"), "tokens").text == "8"
    key = browser.find_element(_by("ID"), "api-key")
    key.clear()
    key.send_keys("wrong")
    status = _generate(browser)
    assert status.get_attribute("data-state") == "error" and status.text.startswith("error: 401")
    for stat in ("tok-s", "alpha", "tpr", "rounds", "tokens"):
        assert browser.find_element(_by("ID"), stat).text == "–", stat


def _last(server, match):
    return [r for r in server.health()["recent"] if match(r)][-1]
