"""The dashboard at /ui in a real headless Chromium (Selenium), against a real local stack: the page loads with no
console errors, a bad config shows its field and creates nothing, a config pasted as YAML is created and started,
the accuracy curve gains points while the test watches, the graph has one node per client, the workers and message
counters show, and Stop stops the run.

DFCA_DASHBOARD_SCREENSHOT=docs/dashboard.png also saves a screenshot of the experiment page while it runs.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from runtime_fixtures import TOKEN, Api, rotated_mnist, running_stack
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture()
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # The background-networking flags keep Chromium off the closed network (its refused connections, its lookups
    # of Google's hosts at every start); a fresh profile of its own for each test.
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1300,1100"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def until(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception:  # an element being redrawn; try again
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def by_testid(driver: webdriver.Chrome, name: str) -> Any:
    return driver.find_element(By.CSS_SELECTOR, f'[data-testid="{name}"]')


def console_errors(driver: webdriver.Chrome) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


@pytest.mark.rabbitmq
def test_the_dashboard_follows_a_run_and_stops_it(rabbitmq_url: str, tmp_path: Path,
                                                   browser: webdriver.Chrome) -> None:
    with running_stack(tmp_path / "state", rabbitmq_url) as stack:
        browser.get(f"{stack.options.metrics_url}/ui")
        until("the experiments table", lambda: by_testid(browser, "experiments"))
        token = by_testid(browser, "token")
        token.send_keys(TOKEN)
        token.send_keys("\t")  # `change` stores it for the session

        area = by_testid(browser, "yaml")  # a bad config: the field is named, nothing is created
        browser.execute_script("arguments[0].value = arguments[1]", area, "name: x\ntrain: {lr: -1}\n")
        by_testid(browser, "create").click()
        message = until("an error", lambda: "train.lr" in by_testid(browser, "create-result").text and
                        by_testid(browser, "create-result").text)
        assert "422" in message
        assert Api.of(stack).topology.get("/experiments").json() == []
        refused = console_errors(browser)  # reading the log empties it: the refused request is the only entry
        assert all("status of 422" in e for e in refused), refused

        # long enough to be running still when the test stops it (40 rounds ended within 9 s once workers got faster)
        cfg = rotated_mnist(name="ui", rounds=1000, dfca={"variant": "paper"}, runtime={"round_timeout": 10.0})
        browser.execute_script("arguments[0].value = arguments[1]", area, yaml.safe_dump(cfg))
        by_testid(browser, "create-start").click()
        until("the experiment page", lambda: "#/e/ui-" in browser.current_url)
        experiment = browser.current_url.rsplit("/", 1)[-1]
        until("status running", lambda: by_testid(browser, "status").text == "running")

        graph_nodes = until("the graph", lambda: browser.find_elements(By.CSS_SELECTOR, '[data-testid="graph-node"]'))
        assert len(graph_nodes) == 24  # one node per client

        def points() -> int:
            return int(by_testid(browser, "curve-accuracy").get_attribute("data-points") or 0)

        first = until("a first point on the accuracy curve", lambda: points() >= 2 and points(), timeout=90)
        until("more points while we watch", lambda: points() >= first + 3, timeout=90)
        fills = browser.execute_script(  # read at once: the graph is redrawn as rounds come in
            "return [...document.querySelectorAll('[data-testid=\"graph-node\"]')].map(n => n.getAttribute('fill'))")
        assert len(fills) == 24 and "#e5e7eb" not in fills  # every client drawn in its assigned cluster's colour
        assert len(browser.find_elements(By.CSS_SELECTOR, '[data-testid^="worker-"]')) == 3
        until("each worker's device", lambda: browser.execute_script(  # read at once: the table is redrawn
            "return [...document.querySelectorAll('[data-testid^=\"worker-\"]')].map(r => r.cells[2].textContent)"
        ) == ["cpu"] * 3)  # where it placed its clients: the stack's workers compute on the CPU
        until("message counters", lambda: by_testid(browser, "messages-applied").text)
        if screenshot := os.environ.get("DFCA_DASHBOARD_SCREENSHOT"):
            browser.save_screenshot(screenshot)

        by_testid(browser, "stop").click()
        until("status stopped", lambda: by_testid(browser, "status").text == "stopped", timeout=60)
        assert Api.of(stack).experiment(experiment)["status"] == "stopped"
        assert console_errors(browser) == []

        browser.get(f"{stack.options.metrics_url}/ui#/")  # the list shows it, with its scores
        row = until("the experiment in the list", lambda: by_testid(browser, f"row-{experiment}"))
        assert "stopped" in row.text and "dfca" in row.text
        assert console_errors(browser) == []
