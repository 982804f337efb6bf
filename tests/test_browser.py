"""The lessons in a real browser (the `--browser` tier; CI runs it after the suite, `.ci/run`): `./run.sh lessons` serves
the learners' copies of lessons 01 and 07 (FAST mode), headless Chromium opens each in JupyterLab's and in Notebook 7's
page, runs the cells the widget needs (not the whole lesson: its experiments are the notebook tests' job), moves a
control with the mouse and sees the figure redrawn, then saves, reopens the copy and finds the widget live again, not
the text Jupyter shows for a widget it cannot render ("VBox(children=...").

Needs Debian's chromium (`apt-get install -y chromium`, /usr/bin/chromium; never a downloaded browser) and the
`playwright` package (`./run.sh python -m pip install playwright`). About 2 minutes on 2 cores (two lessons, ~45 s each).
"""
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("PICOTRON_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOKEN = "picotron-browser-test"
SHOTS = ROOT / "runs" / "browser"  # a screenshot of each page at the end (and when a test fails)

# Per lesson: the cells the widget needs (their sources' first words), the page it opens in, and what to do with
# the mouse: drag a slider, then click a toggle button.
LESSONS = {
    "01_single_device": dict(ui="notebooks", cells=("# A copy of", "import dataclasses", "def textbook", "def draw("),
                             drag="micro-batch b", click="eager"),
    "07_pipeline_parallel": dict(ui="lab/tree", cells=("# A copy of", "import sys", "def draw("),
                                 drag="m (micro-batches)", click=None),
}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`./run.sh lessons 01 07` on a free port, with Jupyter's files (signatures, settings) in a fresh folder."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no {CHROMIUM}: apt-get install -y chromium (or set PICOTRON_CHROMIUM)")
    home = tmp_path_factory.mktemp("jupyter")
    settings = home / "lab-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # every cell in the page (JupyterLab only renders the cells in view by default): the test clicks far down
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    news = home / "lab-settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')  # no pop-up over the widget
    port = _free_port()
    env = {**os.environ, "PICOTRON_NOTEBOOKS": str(home / "notebooks"), "PICOTRON_FAST": "1",
           "JUPYTER_DATA_DIR": str(home / "data"), "JUPYTER_CONFIG_DIR": str(home / "config"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "OMP_NUM_THREADS": "1"}
    log = open(home / "server.log", "w")
    proc = subprocess.Popen(["bash", "run.sh", "lessons", "01", "07", "--no-browser", f"--port={port}",
                             "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=5)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Jupyter did not start: {(home / 'server.log').read_text()[-3000:]}")
            time.sleep(1)
    yield dict(url=url, home=home, log=home / "server.log")
    os.killpg(proc.pid, 15)  # the server and the kernels it started
    proc.wait(timeout=30)
    log.close()


@pytest.fixture(scope="module")
def browser(server):
    sync_api = pytest.importorskip("playwright.sync_api", reason="./run.sh python -m pip install playwright")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(server["home"] / "chromium"), executable_path=CHROMIUM,
                                                       headless=True, args=ARGS, viewport={"width": 1280, "height": 900})
        yield context
        context.close()


def _run_cell(page, cell, count, timeout_s=180):
    """Select the cell by a click on its prompt and run it (Shift+Enter); wait until its prompt shows the kernel's
    execution count `count` (the copy's cells show the committed run's counts before). A run asked for before the
    kernel is connected is dropped (no "[*]"): then ask again."""
    prompt = cell.locator(".jp-InputArea-prompt").first
    deadline, asked = time.monotonic() + timeout_s, 0.0
    while not (m := re.search(r"\[(\d+)\]", prompt.inner_text())) or int(m.group(1)) < count or not asked:
        assert time.monotonic() < deadline, f"the cell did not run: {cell.inner_text()[:200]}"
        if time.monotonic() - asked > 10 and "*" not in prompt.inner_text():
            prompt.click()
            page.keyboard.press("Shift+Enter")
            asked = time.monotonic()
        page.wait_for_timeout(250)


def _figure(cell):
    """The src of the figure's image in the widget's output area (the data: URL of its PNG)."""
    return cell.locator(".widget-output img").first.get_attribute("src")


def _widget_cell(page):
    return page.locator(".jp-CodeCell").filter(has=page.locator(".jp-InputArea-editor", has_text="def draw("))


def _assert_live_widget(cell, lesson):
    """The widget is rendered (controls, each labelled, above ONE figure), not its text."""
    text = cell.locator(".jp-Cell-outputArea").inner_text()
    assert "VBox(children=" not in text, f"{lesson}: the widget shows as text:\n{text[:300]}"
    assert cell.locator(".widget-vbox").count() == 1, f"{lesson}: no live widget"
    labels = [t.strip() for t in cell.locator(".widget-vbox > .widget-inline-hbox > .widget-label").all_inner_texts()]
    assert labels and all(labels), f"{lesson}: a control without a label: {labels}"
    assert cell.locator(".jp-Cell-outputArea img").count() == 1, f"{lesson}: not one figure"


def _drag(page, cell, label):
    """Drag the slider labelled `label` to the right by a quarter of its length with the mouse."""
    row = cell.locator(".widget-slider").filter(has=page.locator(".widget-label", has_text=label))
    handle = row.locator(".noUi-handle")
    handle.scroll_into_view_if_needed()
    track, box = row.locator(".noUi-target").bounding_box(), handle.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + track["width"] / 4, y, steps=12)  # intermediate values: only the release redraws
    page.mouse.up()


def _changed(page, cell, before, lesson, what):
    deadline = time.monotonic() + 60
    while _figure(cell) == before:
        assert time.monotonic() < deadline, f"{lesson}: the figure did not change after {what}"
        page.wait_for_timeout(250)
    return _figure(cell)


@pytest.mark.parametrize("lesson", LESSONS)
def test_widget_in_the_browser(server, browser, lesson):
    spec = LESSONS[lesson]
    page = browser.new_page()
    url = f"{server['url']}/{spec['ui']}/{lesson}/{lesson}.ipynb?token={TOKEN}"
    try:
        page.goto(url)
        page.locator(".jp-Notebook .jp-CodeCell").first.wait_for(timeout=120_000)
        for count, start in enumerate(spec["cells"], 1):
            cells = page.locator(".jp-CodeCell").filter(has=page.locator(".jp-InputArea-editor", has_text=start))
            _run_cell(page, cells.first, count)
        cell = _widget_cell(page).first
        cell.locator(".widget-output img").wait_for(timeout=120_000)
        _assert_live_widget(cell, lesson)
        before = _figure(cell)
        _drag(page, cell, spec["drag"])
        before = _changed(page, cell, before, lesson, f"dragging {spec['drag']!r}")
        if spec["click"]:
            cell.locator("button", has_text=re.compile(f"^{spec['click']}$")).click()
            _changed(page, cell, before, lesson, f"clicking {spec['click']!r}")
        _assert_live_widget(cell, lesson)

        page.keyboard.press("Control+s")  # save, then open the copy again: the same kernel, the widget live again
        page.wait_for_timeout(1500)
        page.goto(url)
        cell = _widget_cell(page).first
        cell.locator(".jp-Cell-outputArea").first.wait_for(timeout=120_000)
        page.wait_for_timeout(3000)  # the widget manager takes the models from the kernel
        _assert_live_widget(cell, lesson)
        before = _figure(cell)
        _drag(page, cell, spec["drag"])
        _changed(page, cell, before, lesson, f"dragging {spec['drag']!r} after reopening")
    finally:
        SHOTS.mkdir(parents=True, exist_ok=True)
        if _widget_cell(page).count():
            _widget_cell(page).first.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / f"{lesson}.png"), full_page=False)
        page.close()
    log = server["log"].read_text()
    assert "without encryption" not in log, log[-2000:]
