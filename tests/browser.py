"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON messages ending
in a NUL byte, commands on the browser's fd 3, replies and events on its fd 4), so tests need no websocket
client: open a local page, run JavaScript in it (a click), and collect what its console reports."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

TIMEOUT_S = 60.0  # per reply: a cold start of Chromium on a busy 2-core machine takes seconds
ERRORS = {"Runtime.exceptionThrown", "Runtime.consoleAPICalled", "Log.entryAdded"}


class Chromium:
    """One headless browser process; `open(path)` loads a local file in a new tab and returns it as a `Tab`."""

    def __init__(self, profile: Path):
        exe = shutil.which("chromium")
        if exe is None:
            raise RuntimeError("Debian's chromium is needed: apt-get install -y chromium (.ci/run installs it)")
        theirs_in, self._out = os.pipe()  # we write, the browser reads its fd 3
        self._in, theirs_out = os.pipe()  # the browser writes its fd 4, we read

        def as_fds_3_and_4():  # in the child, before exec: copies first, so neither dup2 clobbers the other
            a, b = os.dup(theirs_in), os.dup(theirs_out)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", f"--user-data-dir={profile}",
             "--host-resolver-rules=MAP * ~NOTFOUND", "about:blank"],  # no host resolves: a fetch would fail loudly
            preexec_fn=as_fds_3_and_4, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(theirs_in)
        os.close(theirs_out)
        self._buf, self._n, self.events = b"", 0, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.send("Browser.close")
            self.proc.wait(10)
        except (OSError, EOFError, TimeoutError, subprocess.TimeoutExpired):
            self.proc.kill()
        os.close(self._out)
        os.close(self._in)

    def send(self, method: str, session: str | None = None, **params) -> dict:
        self._n += 1
        msg = {"id": self._n, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._receive(time.monotonic() + TIMEOUT_S)
            if reply.get("id") == self._n:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._in], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise EOFError("chromium exited")
            self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return json.loads(msg)

    def wait_for(self, method: str, session: str):
        """Until the event `method` of that tab has arrived (kept in `events`)."""
        deadline = time.monotonic() + TIMEOUT_S
        while not any(e.get("method") == method and e.get("sessionId") == session for e in self.events):
            self.events.append(self._receive(deadline))

    def open(self, path: Path, fragment: str = "") -> Tab:
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable", session)
        self.send("Page.navigate", session, url=Path(path).resolve().as_uri() + fragment)
        self.wait_for("Page.loadEventFired", session)
        return Tab(self, session)


class Tab:
    def __init__(self, browser: Chromium, session: str):
        self.browser, self.session = browser, session

    def eval(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-able), or a RuntimeError with its exception."""
        out = self.browser.send("Runtime.evaluate", self.session, expression=expression, returnByValue=True,
                                awaitPromise=True)
        if "exceptionDetails" in out:
            raise RuntimeError(out["exceptionDetails"].get("exception", {}).get("description", str(out)))
        return out["result"].get("value")

    def console_errors(self) -> list[str]:
        """Uncaught exceptions, console.error/warn calls and browser log errors (failed loads, refused resources)."""
        self.eval("0")  # a round trip: events raised so far have arrived
        out = []
        for e in self.browser.events:
            if e.get("sessionId") != self.session or e.get("method") not in ERRORS:
                continue
            p = e["params"]
            if e["method"] == "Runtime.exceptionThrown":
                out.append(p["exceptionDetails"].get("exception", {}).get("description") or p["exceptionDetails"]["text"])
            elif e["method"] == "Runtime.consoleAPICalled" and p["type"] in ("error", "warning", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif e["method"] == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
                out.append(p["entry"]["text"])
        return out
