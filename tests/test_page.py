"""The live page at / in a real browser: headless Chromium (Debian's chromium and
chromium-driver) driven by selenium submits a prompt, waits for the streamed text, and
finds tokens coloured as accepted draft proposals and as the target's corrections.
The screenshot goes to the test's folder; SPEL_SCREENSHOT=PATH also saves it there
(the README's docs/img/server_page.png is made that way)."""
import os
import shutil
import urllib.request

import pytest

import spel_mlx  # noqa: F401
from conftest import require_or_skip

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
PROMPT = "It is a truth universally acknowledged, that"


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
    srv = LiveServer("--api-key", "page-key", log_dir=tmp_path_factory.mktemp("page"))
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


def test_page_is_all_local(server):
    html = urllib.request.urlopen(server.url + "/").read().decode()
    assert "/static/page.js" in html and "/static/page.css" in html
    assert "http://" not in html and "https://" not in html      # no external scripts or fonts
    for name in ("page.js", "page.css"):
        with urllib.request.urlopen(f"{server.url}/static/{name}") as r:
            body = r.read().decode()
            assert r.status == 200 and "https://" not in body and "@import" not in body


def test_page_streams_coloured_tokens(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    browser.get(server.url + "/")
    key = browser.find_element(By.ID, "api-key")
    key.send_keys("page-key\t")                                  # tab: the change event asks /v1/models
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model").text == "spel-mlx-default")
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(PROMPT)
    for field, value in (("max-tokens", "120"), ("temperature", "0"), ("seed", "1")):
        el = browser.find_element(By.ID, field)
        el.clear()
        el.send_keys(value)
    browser.find_element(By.ID, "generate").click()
    status = browser.find_element(By.ID, "status")
    WebDriverWait(browser, 60).until(lambda d: status.get_attribute("data-state") in ("done", "error"))
    assert status.get_attribute("data-state") == "done", status.text
    assert status.text == "done: length, 120 tokens"
    draft = browser.find_elements(By.CSS_SELECTOR, "#output .tok.draft")
    target = browser.find_elements(By.CSS_SELECTOR, "#output .tok.target")
    assert len(draft) + len(target) == 120 and draft and target
    colours = {e.value_of_css_property("background-color") for e in (draft[0], target[0])}
    assert len(colours) == 2                                     # the two origins look different
    assert browser.find_element(By.ID, "output").text.strip()
    assert int(browser.find_element(By.ID, "rounds").text) == len(target)   # one target token per round
    assert float(browser.find_element(By.ID, "alpha").text) > 0
    assert float(browser.find_element(By.ID, "tok-s").text) > 0
    assert browser.find_elements(By.CSS_SELECTOR, "#chart rect.d") and browser.find_elements(By.CSS_SELECTOR,
                                                                                            "#chart rect.t")
    shot = tmp_path / "server_page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if os.environ.get("SPEL_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["SPEL_SCREENSHOT"])


def test_page_reports_a_wrong_key(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    browser.get(server.url + "/")
    key = browser.find_element(By.ID, "api-key")
    key.clear()
    key.send_keys("wrong")
    browser.find_element(By.ID, "generate").click()
    status = browser.find_element(By.ID, "status")
    WebDriverWait(browser, 30).until(lambda d: status.get_attribute("data-state") == "error")
    assert status.text.startswith("error: 401")
