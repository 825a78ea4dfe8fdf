"""Headless Chromium, driven through its DevTools pipe: the browser of the dashboard's tests
and of the plugin page's first-paint benchmark.

Example:
    >>> browser = Chromium("chromium", Path("profile"))  # doctest: +SKIP
    >>> browser.call("Page.navigate", page=True, url="http://127.0.0.1:6006/")  # doctest: +SKIP
    >>> browser.evaluate("document.title")  # doctest: +SKIP
    'TensorBoard'
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import subprocess
import time
from pathlib import Path

__all__ = ["Chromium"]


class Chromium:
    """Headless Chromium driven through its DevTools pipe: NUL-terminated JSON on fds 3 and 4.

    The custom-scalars page is built of web components whose charts live in shadow roots,
    which ``--dump-dom`` leaves out; the DevTools protocol evaluates a script that walks them.
    """

    def __init__(self, binary: str, profile: Path, width: int = 1400, height: int = 1000):
        to_chromium, self._to_w = os.pipe()
        self._from_r, from_chromium = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"]
        # bash moves the pipe ends to fds 3 and 4, where Chromium expects them: no Python
        # runs between fork and exec (a preexec_fn would, in a process with JAX's threads).
        # Copies numbered 10 and up, so that moving them never overwrites one another.
        a, b = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_chromium, from_chromium))
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{a} 4>&{b} {a}<&- {b}>&-', binary, *flags],
            pass_fds=(a, b), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fd in (a, b, to_chromium, from_chromium):
            os.close(fd)
        self._buffer = b""
        self._id = 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target,
                                  flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", page=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def call(self, method: str, page: bool = False, **params: object) -> dict:
        self._id += 1
        message: dict[str, object] = {"id": self._id, "method": method, "params": params}
        if page:
            message["sessionId"] = self._session
        os.write(self._to_w, json.dumps(message).encode() + b"\0")
        while True:  # events arrive between the replies: skip them
            while b"\0" not in self._buffer:
                chunk = os.read(self._from_r, 1 << 20)
                assert chunk, f"Chromium closed its DevTools pipe (exit {self.proc.poll()})"
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                assert "error" not in reply, reply
                return reply["result"]

    def evaluate(self, expression: str) -> object:
        result = self.call("Runtime.evaluate", page=True, expression=expression,
                           returnByValue=True)
        return result["result"].get("value")

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", page=True,
                                          format="png")["data"])

    def frame(self, expression: str) -> object:
        """Evaluates ``expression`` with ``doc`` and ``win`` bound to the document and window of
        TensorBoard's plugin frame (null while the frame is not there)."""
        return self.evaluate(
            "(() => { const f = document.querySelector('iframe'); const win = f && "
            "f.contentWindow; const doc = f && f.contentDocument; if (!doc || !doc.body) "
            f"return null; return ({expression}); }})()")

    def full_screenshot(self, width: int = 1400, extra: int = 80) -> bytes:
        """A screenshot of TensorBoard's page tall enough for the whole plugin frame, whose
        content otherwise scrolls inside a frame of the window's height."""
        height = self.frame("doc.documentElement.scrollHeight")
        if isinstance(height, (int, float)):
            self.call("Emulation.setDeviceMetricsOverride", page=True, width=width,
                      height=int(height) + extra, deviceScaleFactor=1, mobile=False)
            time.sleep(0.6)  # the frame lays out again at the new size
        return self.screenshot()

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.proc.wait(30)
        except (AssertionError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self._to_w)
            os.close(self._from_r)
