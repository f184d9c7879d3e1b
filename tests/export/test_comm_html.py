"""The CommDebugMode browser view, opened in headless Chromium: the tree's text, folding, and a screenshot.

Chromium is driven over its DevTools protocol on a pipe (--remote-debugging-pipe: JSON messages ending in NUL
on fds 3 and 4), so no webdriver package is needed. Debian: `apt-get install -y chromium`.
"""
import base64
import json
import os
import select
import shutil
import subprocess
import time

import pytest
import torch

from conftest import tiny_config
from syntorch import CommDebugMode
from syntorch.models import build_model
from syntorch.parallel import distributed as comm
from syntorch.parallel.tensor import apply_tp

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,1100", "--remote-debugging-pipe"]


class Chromium:
    """Headless Chromium with one page, driven by DevTools protocol commands over a pipe."""

    def __init__(self, profile_dir, timeout_s: float = 30.0):
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        if binary is None:  # CI installs it and sets SYNTORCH_REQUIRE_BROWSER, so there a missing browser fails
            missing = "chromium is not installed; install it with `apt-get update && apt-get install -y chromium`"
            if os.environ.get("SYNTORCH_REQUIRE_BROWSER"):
                pytest.fail(missing)
            pytest.skip(missing)
        self.timeout_s, self.next_id, self.buffer = timeout_s, 0, b""
        to_browser, self._to_browser = os.pipe()
        self._from_browser, from_browser = os.pipe()

        def on_fds_3_and_4():  # the browser reads commands on fd 3 and writes replies on fd 4
            read, write = os.dup(to_browser), os.dup(from_browser)
            os.dup2(read, 3)
            os.dup2(write, 4)

        self.process = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}", "about:blank"],
                                        preexec_fn=on_fds_3_and_4, close_fds=False,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_browser)
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def send(self, method: str, session: str | None = None, **params) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self.next_id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]

    def _read_message(self) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while b"\0" not in self.buffer:
            ready, _, _ = select.select([self._from_browser], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self._from_browser, 1 << 20) if ready else b""
            assert chunk, "chromium stopped answering"
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def page(self, method: str, **params) -> dict:
        return self.send(method, self.session, **params)

    def open(self, path):
        self.page("Page.navigate", url=f"file://{path}")
        deadline = time.monotonic() + self.timeout_s
        while self.js("document.readyState") != "complete":
            assert time.monotonic() < deadline, f"{path} did not load"
            time.sleep(0.05)

    def js(self, expression: str):
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def click(self, selector: str):
        """A real mouse click in the middle of the element, as a user's."""
        element = f"document.querySelector({json.dumps(selector)})"
        self.js(f"{element}.scrollIntoView({{block: 'center'}})")  # the mouse only reaches the viewport
        box = json.loads(self.js(f"JSON.stringify({element}.getBoundingClientRect())"))
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        for event in ("mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", type=event, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path):
        path.write_bytes(base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"]))

    def close(self):
        try:
            self.send("Browser.close")
            self.process.wait(timeout=10)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            os.close(self._to_browser)
            os.close(self._from_browser)


@pytest.fixture(scope="module")
def report_page(tmp_path_factory):
    """The HTML of a TP-2 tiny GPT forward + backward (fake process group), at noise level 1."""
    config = tiny_config("gpt2", n_layer=2)
    with comm.symbolic_world(0, 2):
        model = build_model(config)
        apply_tp(model)
        mode = CommDebugMode(model, meta={"model": config.name, "tp": 2})
        with mode:
            model(torch.randint(0, config.vocab_size, (2, 8))).sum().backward()
    path = tmp_path_factory.mktemp("html") / "comm.html"
    mode.generate_html(file_name=path, noise_level=1)
    return path


@pytest.fixture
def browser(tmp_path):
    chromium = Chromium(tmp_path / "profile")
    yield chromium
    chromium.close()


def visible(browser: Chromium, fqn: str) -> bool:
    """Whether the module's folded part (its tables and children) is shown."""
    return browser.js(f'document.querySelector(\'li[data-fqn="{fqn}"] > .nested\').checkVisibility()')


def test_page_is_self_contained(report_page):
    page = report_page.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script>" in page
    for outside in ("http://", "https://", "src=", "<link", "@import"):
        assert outside not in page, f"the page fetches something ({outside}); it must work offline"


def test_tree_text_and_folding_in_chromium(report_page, browser, tmp_path):
    browser.open(report_page)
    tree = browser.js("document.getElementById('tree').innerText")
    assert tree.startswith("Global") and "all_reduce \u00d75" in tree  # embedding + 2 per layer, forward
    assert "layers.0" in tree and "layers.1" in tree and "lm_head" in tree
    assert "layers.0.mlp" not in tree  # folded: only Global's children show at first
    assert visible(browser, "Global") and not visible(browser, "layers.0")

    browser.click('li[data-fqn="layers.0"] > .caret')
    assert visible(browser, "layers.0") and not visible(browser, "layers.0.mlp")
    browser.click('li[data-fqn="layers.0.mlp"] > .caret')
    browser.click('li[data-fqn="layers.0.mlp.fc2"] > .caret')
    fc2 = browser.js("document.querySelector('li[data-fqn=\"layers.0.mlp.fc2\"]').innerText")
    assert "FORWARD PASS" in fc2 and "all_reduce" in fc2 and "group: [0, 1]" in fc2 and "weight" in fc2
    browser.screenshot(tmp_path / "expanded.png")
    shot = os.environ.get("SYNTORCH_COMM_SCREENSHOT")  # to look at it: SYNTORCH_COMM_SCREENSHOT=/tmp/x.png
    if shot:
        shutil.copy(tmp_path / "expanded.png", shot)
    assert (tmp_path / "expanded.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    browser.click('li[data-fqn="layers.0"] > .caret')  # folds again, children and all
    assert not visible(browser, "layers.0") and not browser.js(
        "document.querySelector('li[data-fqn=\"layers.0.mlp.fc2\"] > .caret').checkVisibility()")
    browser.click("#expand-all")
    assert visible(browser, "layers.1.attn.qkv")


def test_decode_steps_fold_in_the_browser(browser, tmp_path):
    """A 20-token generation under TP 2: the 19 decode steps are one row per collective, with their count."""
    from syntorch.export.comm_report import write_html
    from syntorch.trace.comm_view import CommReport
    from syntorch.trace.generation import trace_tp_rank

    graph = trace_tp_rank(tiny_config("gpt2", n_layer=2), torch.zeros(1, 4, dtype=torch.long), 20, tp=2, rank=0)[0]
    write_html(CommReport(graph), 1, tmp_path / "steps.html")
    browser.open(tmp_path / "steps.html")
    cells = json.loads(browser.js("JSON.stringify([...[...document.querySelectorAll('table')].at(-1).rows].slice(1)"
                                  ".map(r => [...r.cells].map(c => c.innerText)))"))  # the collectives
    assert len(cells) == 2 * 6 and sum(int(row[3]) for row in cells) == 20 * 6  # the steps column
    assert [row[2] for row in cells] == ["prefill"] * 6 + ["decode[0–18] × 19"] * 6
    browser.click('li[data-fqn="layers.0"] > .caret')
    browser.click('li[data-fqn="layers.0.mlp"] > .caret')
    browser.click('li[data-fqn="layers.0.mlp.fc2"] > .caret')
    fc2 = browser.js("document.querySelector('li[data-fqn=\"layers.0.mlp.fc2\"]').innerText")
    # its matmul, its all-reduce and its bias (added after the all-reduce), once each for the 19 steps
    assert fc2.count("decode[0–18] × 19") == 3 and "decode[1]" not in fc2
    browser.screenshot(tmp_path / "steps.png")
    assert (tmp_path / "steps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
