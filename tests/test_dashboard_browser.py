"""The dashboard at /ui in a real headless Chromium (Selenium), against a real local stack (one for the module): the
page loads with no console errors, a bad config shows its field and creates nothing, a config pasted as YAML is
created and started, the accuracy curve gains points while the test watches, the graph has one node per client, the
workers and message counters show, and Stop stops the run. A finished run reads at a glance: at ARI 1 every node of
the graph is filled in its ring's colour (assigned clusters matched to true ones), the legend, the summary, the
config and the round show, the curves have axes and hover values, and the final models' links answer.

DFCA_DASHBOARD_SCREENSHOT=docs/dashboard.png also saves a screenshot of the finished run's page.
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
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from dfca.cli.launcher import Stack

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def stack(rabbitmq_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("dashboard") / "state", rabbitmq_url) as running:
        yield running


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


def read_of(driver: webdriver.Chrome, name: str, read: Callable[[Any], Any], tries: int = 20) -> Any:
    """read(element) of the element named `name`, found again where the dashboard redrew it between finding and
    reading (a stale element: its table is rebuilt on every refresh)."""
    for _ in range(tries - 1):
        try:
            return read(by_testid(driver, name))
        except StaleElementReferenceException:
            time.sleep(0.05)
    return read(by_testid(driver, name))


def text_of(driver: webdriver.Chrome, name: str) -> str:
    return read_of(driver, name, lambda e: e.text)


def attribute_of(driver: webdriver.Chrome, name: str, attribute: str) -> str | None:
    return read_of(driver, name, lambda e: e.get_attribute(attribute))


def console_errors(driver: webdriver.Chrome) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def sign_in(driver: webdriver.Chrome, stack: Stack) -> None:
    """Without the token the page says the read was refused; typed in, it shows the experiments."""
    driver.get(f"{stack.options.metrics_url}/ui")
    until("the refused read", lambda: "401" in text_of(driver, "page-error"))
    driver.get_log("browser")  # the refused reads are expected: empty the console log
    token = by_testid(driver, "token")
    token.send_keys(TOKEN)
    token.send_keys("\t")  # `change` stores it for the session and shows the page again
    until("the experiments table", lambda: by_testid(driver, "experiments"))


GRAPH_NODES = "return (window.dfcaGraphOption || {series: [{data: []}]}).series[0].data"


@pytest.mark.rabbitmq
def test_the_dashboard_follows_a_run_and_stops_it(stack: Stack, browser: webdriver.Chrome) -> None:
    sign_in(browser, stack)

    area = by_testid(browser, "yaml")  # a bad config: the field is named, nothing is created
    browser.execute_script("arguments[0].value = arguments[1]", area, "name: x\ntrain: {lr: -1}\n")
    by_testid(browser, "create").click()
    message = until("an error", lambda: "train.lr" in text_of(browser, "create-result") and
                    text_of(browser, "create-result"))
    assert "422" in message
    assert [e for e in Api.of(stack).topology.get("/experiments").json() if e["name"] == "x"] == []
    refused = console_errors(browser)  # reading the log empties it: the refused request is the only entry
    assert all("status of 422" in e for e in refused), refused

    # long enough to be running still when the test stops it (40 rounds ended within 9 s once workers got faster)
    cfg = rotated_mnist(name="ui", rounds=1000, dfca={"variant": "paper"}, runtime={"round_timeout": 10.0})
    browser.execute_script("arguments[0].value = arguments[1]", area, yaml.safe_dump(cfg))
    by_testid(browser, "create-start").click()
    until("the experiment page", lambda: "#/e/ui-" in browser.current_url)
    experiment = browser.current_url.rsplit("/", 1)[-1]
    until("status running", lambda: text_of(browser, "status") == "running")

    graph_nodes = until("the graph", lambda: browser.execute_script(GRAPH_NODES))
    assert len(graph_nodes) == 24  # one node per client

    def points() -> int:
        return int(attribute_of(browser, "curve-accuracy", "data-points") or 0)

    first = until("a first point on the accuracy curve", lambda: points() >= 2 and points(), timeout=90)
    until("more points while we watch", lambda: points() >= first + 3, timeout=90)
    fills = until("every client evaluated", lambda: [n["itemStyle"]["color"]  # read at once: the graph is redrawn
                                                     for n in browser.execute_script(GRAPH_NODES)
                                                     if n["dfca"] is not None])
    assert len(fills) == 24 and "#e5e7eb" not in fills  # every client drawn in its assigned cluster's colour
    assert len(browser.find_elements(By.CSS_SELECTOR, '[data-testid^="worker-"]')) == 3
    until("each worker's device", lambda: browser.execute_script(  # read at once: the table is redrawn
        "return [...document.querySelectorAll('[data-testid^=\"worker-\"]')].map(r => r.cells[2].textContent)"
    ) == ["cpu"] * 3)  # where it placed its clients: the stack's workers compute on the CPU
    until("message counters", lambda: text_of(browser, "messages-applied"))

    by_testid(browser, "stop").click()
    until("status stopped", lambda: text_of(browser, "status") == "stopped", timeout=60)
    assert Api.of(stack).experiment(experiment)["status"] == "stopped"
    assert console_errors(browser) == []

    browser.get(f"{stack.options.metrics_url}/ui#/")  # the list shows it, with its scores
    row = until("the experiment in the list", lambda: text_of(browser, f"row-{experiment}"))
    assert "stopped" in row and "dfca" in row
    assert console_errors(browser) == []


CHART_OPTION = ("return echarts.getInstanceByDom(document.querySelector(`[data-testid=\"${arguments[0]}\"]`))"
                ".getOption()")


@pytest.mark.rabbitmq
def test_a_finished_run_reads_at_a_glance(stack: Stack, browser: webdriver.Chrome) -> None:
    api = Api.of(stack)
    experiment = api.create_and_start(rotated_mnist(name="glance"))
    api.wait_finished(experiment, timeout=300)
    summary = api.summary(experiment)
    assert summary["status"] == "completed" and summary["cluster_ari"] == 1.0, summary
    evaluated = api.metrics.get(f"/experiments/{experiment}/clients").json()
    # the run numbers its clusters otherwise than the truth: a fill equals its ring only through the matching
    assert evaluated["assigned"] != evaluated["true_cluster"], "this seed no longer tests the matching: pick another"

    sign_in(browser, stack)
    browser.get(f"{stack.options.metrics_url}/ui#/e/{experiment}")
    until("status completed", lambda: text_of(browser, "status") == "completed")
    nodes = until("every client in the graph", lambda: (lambda ns: len(ns) == 24 and all(n["dfca"] for n in ns)
                                                         and ns)(browser.execute_script(GRAPH_NODES)))
    fills = [n["itemStyle"]["color"] for n in nodes]
    rings = [n["itemStyle"]["borderColor"] for n in nodes]
    assert fills == rings  # ARI 1: every client drawn in its true cluster's colour, filled and ringed
    assert len(set(rings)) == 2  # the two true clusters, two colours

    legend = text_of(browser, "graph-legend")
    assert "fill = assigned cluster" in legend and "ring = true cluster" in legend
    assert "cluster 0" in legend and "cluster 1" in legend
    assert text_of(browser, "legend-misclustered") == "every client in its true cluster"

    assert text_of(browser, "round") == "round 10 of 10"
    assert text_of(browser, "summary-ari").startswith("1.00")
    assert text_of(browser, "summary-accuracy").startswith(f"{summary['test_accuracy']:.3f}")
    assert text_of(browser, "summary-clustered-right").startswith("24 of 24")
    assert text_of(browser, "summary-rounds").startswith("10 of 10 (after 8 seeding)")
    assert [text_of(browser, f"worker-{w}").split()[3] for w in range(3)] == ["10/10"] * 3
    config = text_of(browser, "config")
    assert "name: glance" in config and "clusters: 2" in config and "rotations: [0, 180]" in config

    for testid in ("curve-accuracy", "curve-ari", "curve-loss", "curve-clusters"):
        option = browser.execute_script(CHART_OPTION, testid)
        assert option["xAxis"][0]["name"] == "training round" and option["yAxis"][0]["axisLabel"]["fontSize"], testid
        xs = [point[0] for point in option["series"][0]["data"]]
        assert min(xs) > 0 and xs[-1] == 10  # seeding inside (0, 1), then training rounds 1..10, as the plots draw
        assert option["tooltip"][0]["trigger"] == "axis", testid  # hover values
        assert len(option["series"][0]["data"]) == int(attribute_of(browser, testid, "data-points")) > 0
    ari = browser.execute_script(CHART_OPTION, "curve-ari")
    assert ari["series"][0]["data"][-1][1] == 1.0 and ari["series"][0]["data"][-1][2] == "round 10 of 10"

    model = until("the final model's link", lambda: browser.find_element(
        By.CSS_SELECTOR, '[data-testid^="download-models-"][data-testid$=".safetensors"]').get_attribute("href"))
    assert by_testid(browser, "download-models-assignments.json")
    until("the plots' links", lambda: browser.find_elements(By.CSS_SELECTOR, '[data-testid^="download-plots-"]'))
    answered = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0]).then(r => r.arrayBuffer().then(b => done([r.status, b.byteLength])))",
        model)
    assert answered[0] == 200 and answered[1] > 1000
    assert console_errors(browser) == []

    if screenshot := os.environ.get("DFCA_DASHBOARD_SCREENSHOT"):
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1300, height + 140)
        time.sleep(1.5)  # the charts redraw at the new size
        browser.save_screenshot(screenshot)
        from PIL import Image  # matplotlib's dependency: a palette of 256 colours keeps the PNG small

        Image.open(screenshot).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(screenshot,
                                                                                                  optimize=True)
