"""A real headless Chromium, driven over the DevTools protocol (a websocket, through aiohttp).

:func:`open_page` loads a file and returns what a reader's browser made of it: the
requests the page made, the console errors and uncaught exceptions, a screenshot, and the
values of JavaScript expressions evaluated in the page (DOM queries).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LOAD_TIMEOUT_S = 60


@dataclass
class PageVisit:
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    screenshot: bytes = b""
    values: dict[str, Any] = field(default_factory=dict)


class _Session:
    """Commands and events of one page target."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, visit: PageVisit) -> None:
        self.ws = ws
        self.visit = visit
        self.ids = itertools.count(1)
        self.loaded = asyncio.Event()

    def _event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Network.requestWillBeSent":
            self.visit.requests.append(params["request"]["url"])
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.visit.errors.append(f"console: {params['args']}")
        elif method == "Runtime.exceptionThrown":
            self.visit.errors.append(f"exception: {params['exceptionDetails']}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.visit.errors.append(f"log: {params['entry'].get('text')}")
        elif method == "Page.loadEventFired":
            self.loaded.set()

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self.ids)
        await self.ws.send_json({"id": n, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=LOAD_TIMEOUT_S)
            if msg.get("id") == n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))
            if "method" in msg:
                self._event(msg["method"], msg.get("params", {}))

    async def wait_loaded(self) -> None:
        while not self.loaded.is_set():
            msg = await self.ws.receive_json(timeout=LOAD_TIMEOUT_S)
            if "method" in msg:
                self._event(msg["method"], msg.get("params", {}))


def _devtools_port(proc: subprocess.Popen[str]) -> int:
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
        if found:
            # Read on, or a full pipe would block Chromium's logging.
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return int(found.group(1))
    raise RuntimeError(f"chromium exited ({proc.wait()}) without opening DevTools")


async def _visit(port: int, url: str, expressions: Sequence[str], height: int) -> PageVisit:
    visit = PageVisit()
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json()
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        async with http.ws_connect(ws_url, max_msg_size=0) as ws:
            page = _Session(ws, visit)
            for domain in ("Page", "Runtime", "Log", "Network"):
                await page.call(f"{domain}.enable")
            await page.call("Emulation.setDeviceMetricsOverride", width=1200, height=height,
                            deviceScaleFactor=1, mobile=False)
            await page.call("Page.navigate", url=url)
            await page.wait_loaded()
            for expr in expressions:
                res = await page.call("Runtime.evaluate", expression=expr, returnByValue=True)
                visit.values[expr] = res["result"].get("value")
            shot = await page.call("Page.captureScreenshot", format="png")
            visit.screenshot = base64.b64decode(shot["data"])
    return visit


def open_page(path: Path, expressions: Sequence[str] = (), height: int = 900) -> PageVisit:
    """Load ``path`` in a fresh headless Chromium profile, in a window 1200 pixels wide
    and ``height`` high; evaluate ``expressions``."""
    assert CHROMIUM, "chromium is not installed"
    with tempfile.TemporaryDirectory() as profile:
        # --no-sandbox: the tests may run as root, where Chromium's sandbox refuses to start.
        proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
             f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        try:
            port = _devtools_port(proc)
            return asyncio.run(_visit(port, path.resolve().as_uri(), expressions, height))
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop Chromium and every helper it started (its own session's process group). Its
    helpers can outlive the browser process when only that one is signalled, and one still
    writing into the profile made removing the profile fail ("Directory not empty")."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
    proc.wait()
