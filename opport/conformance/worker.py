"""Crash isolation: cases run in worker processes; the parent owns the report (docs/numerics.md section 6).

The parent hands each worker a batch (one op x backend x dtype, or one op's bad inputs). The worker
rebuilds the batch's items itself (they are deterministic), announces each case before running it
and sends its result after. So when a worker dies (segfault, abort, `os._exit`), hangs past the
per-case timeout, or reports a device error that poisons its context, the parent knows exactly
which case did it: that case becomes `crash` or `timeout`, the worker is replaced, and the batch
resumes at the next case. Workers are fresh interpreters (never forks), so a parent that touched a GPU is safe.
faulthandler writes each worker's Python stack to a file the parent quotes in crash/timeout messages.
"""

from __future__ import annotations

import collections
import faulthandler
import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait

ENUMERATE_TIMEOUT = 600.0  # building a batch's cases (Hypothesis draws, big fixed cases)
KILL_GRACE = 0.5  # after asking a hung worker for its stack


@dataclass(frozen=True)
class Batch:
    kind: str  # "cases" | "errors"
    op: str
    backend: str
    dtype: str  # "n/a" for bad inputs
    sel: object  # cases.Selection
    start: int = 0

    @property
    def key(self) -> str:
        return f"{self.op}/{self.backend}/{self.dtype}"


def build_items(batch: Batch) -> list:
    from opport.conformance.cases import error_items, items_for
    from opport.ops import get_op

    spec = get_op(batch.op)
    if batch.kind == "errors":
        return error_items(spec, batch.backend, batch.sel)
    return items_for(spec, batch.backend, batch.dtype, batch.sel)


class SetupError(ValueError):
    """A --setup hook could not be imported or failed."""


def run_setup(setup: tuple):
    """Call each "module:function" (e.g. to register a test backend) in this process."""
    for ref in setup:
        mod, _, fn = ref.partition(":")
        try:
            getattr(importlib.import_module(mod), fn)()
        except Exception as e:
            raise SetupError(f"--setup {ref}: {type(e).__name__}: {e}") from e


def run_batch(batch: Batch, send):
    """Enumerate and run a batch in this process, reporting through `send(message)`."""
    for msg in batch_messages(batch):
        send(msg)
        if msg[0] == "exit":
            os._exit(3)  # a poisoned device context: let the parent start a fresh process


def batch_messages(batch: Batch):
    """The messages of running a batch here, in order: ("count", n), then ("start", i, skeleton) and
    ("result", i, result) per case, then ("done",); ("batch_error", why) if its cases cannot be built;
    ("exit",) after a result that left the device unusable (the caller must end this process)."""
    from opport.conformance.execute import new_result, run_item
    from opport.dispatch import get_backend

    t0 = time.perf_counter()
    try:
        items = build_items(batch)
    except Exception as e:  # a broken case generator fails its batch, not the run
        import traceback

        yield ("batch_error", f"building the cases failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
        return
    build_s = round(time.perf_counter() - t0, 4)  # drawing examples, building fixed cases: the op's time too
    yield ("count", len(items))
    checked = get_backend(batch.backend).capabilities.checked  # e.g. the NKI emulator's capacity as an error
    for i in range(batch.start, len(items)):
        yield ("start", i, dict(new_result(items[i]), index=i))
        with checked():
            res = dict(run_item(items[i]), index=i)
        if i == batch.start:
            res["build_s"] = build_s
        yield ("result", i, res)
        if res.get("sticky"):
            yield ("exit",)
            return
    yield ("done",)


def worker_main(fd: int, fault_path: str, setup: tuple):
    """Entry point of a worker process: serve batches from the parent over the socket `fd`."""
    conn = Connection(fd)
    with open(fault_path, "w") as fault:
        faulthandler.enable(fault)
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=fault, all_threads=True)
        run_setup(setup)
        while True:
            batch = conn.recv()
            if batch is None:
                return
            run_batch(batch, conn.send)


# --------------------------------------------------------------------------- the parent side

_BOOT = ("import sys; from opport.conformance.worker import worker_main; "
         "worker_main(int(sys.argv[1]), sys.argv[2], tuple(sys.argv[3:]))")


class _Worker:
    """A fresh interpreter (not a fork, nor multiprocessing's spawn, which re-runs the parent's __main__)."""

    def __init__(self, setup: tuple):
        fd, self.fault = tempfile.mkstemp(prefix="opport-worker-", suffix=".txt")
        os.close(fd)
        mine, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the parent's import path
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno()), self.fault, *setup],
                                     pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.conn = Connection(mine.detach())
        self.batch: Batch | None = None
        self.current = None  # (index, skeleton result) of the case in progress
        self.next_index = 0
        self.total = None
        self.deadline = None
        self.seen: set = set()  # (op, backend) already run here: compile time is paid

    def assign(self, batch: Batch):
        self.batch, self.current, self.next_index, self.total = batch, None, batch.start, None
        self.deadline = time.monotonic() + ENUMERATE_TIMEOUT
        self.conn.send(batch)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stack(self) -> str:
        try:
            with open(self.fault) as f:
                text = f.read().strip()
        except OSError:
            return ""
        return "\n".join(text.splitlines()[:16])  # most recent call first: the kernel's frames lead

    def stop(self, kill: bool = False):
        if self.alive() and not kill:
            try:
                self.conn.send(None)
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self.conn.close()
        try:
            os.unlink(self.fault)
        except OSError:
            pass


class Pool:
    """Runs batches on `n` spawned workers; `sink(result)` gets every case result, `on_count(n)` batch sizes,
    `on_done(batch)` each batch once it is finished (run to its end, lost for good, or abandoned)."""

    def __init__(self, n: int, setup: tuple, timeout: float, compile_timeout: float, sink, on_count=lambda n: None,
                 restart_cap: int | None = None, on_done=lambda batch: None):
        self.n, self.setup, self.timeout, self.compile_timeout = n, setup, timeout, compile_timeout
        self.sink, self.on_count, self.on_done = sink, on_count, on_done
        self.restart_cap = 4 * n if restart_cap is None else restart_cap  # pytest-xdist's default
        self.restarts = 0

    def run(self, batches: list):
        queue = collections.deque(batches)
        workers = [_Worker(self.setup) for _ in range(min(self.n, len(queue)) or 1)]
        try:
            while queue or any(w.batch for w in workers):
                for w in workers:
                    if w.batch is None and queue:
                        w.assign(queue.popleft())
                busy = [w for w in workers if w.batch is not None]
                wait([w.conn for w in busy], timeout=0.25)
                for i, w in enumerate(workers):
                    if w.batch is None:
                        continue
                    replacement = self._service(w, queue)
                    if replacement is not None:
                        workers[i] = replacement
                if self.restarts > self.restart_cap:
                    self._abandon(queue, workers)
                    break
        finally:
            for w in workers:
                w.stop(kill=w.batch is not None)

    def _service(self, w: _Worker, queue) -> _Worker | None:
        """Drain `w`'s messages; on death or timeout, report and return its replacement."""
        try:
            while w.conn.poll():
                self._message(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        if w.batch is None:
            return None
        if not w.alive():
            return self._lost(w, queue, "crash", _death(w.proc.returncode))
        if w.deadline is not None and time.monotonic() > w.deadline:
            if hasattr(signal, "SIGUSR1"):
                os.kill(w.proc.pid, signal.SIGUSR1)  # faulthandler dumps where it hangs
                time.sleep(KILL_GRACE)
            w.proc.kill()
            w.proc.wait()
            limit = "case" if w.current else "building the batch"
            return self._lost(w, queue, "timeout", f"{limit} exceeded its time limit; worker killed")
        return None

    def _message(self, w: _Worker, msg):
        kind = msg[0]
        if kind == "count":
            w.total = msg[1]
            self.on_count(max(0, msg[1] - w.batch.start))
        elif kind == "start":
            w.current = (msg[1], msg[2])
            first = (w.batch.op, w.batch.backend) not in w.seen
            w.deadline = time.monotonic() + self.timeout + (self.compile_timeout if first else 0.0)
        elif kind == "result":
            w.current, w.next_index, w.deadline = None, msg[1] + 1, None
            w.seen.add((w.batch.op, w.batch.backend))
            self.sink(msg[2])
        elif kind == "batch_error":
            self.sink(_batch_result(w.batch, "error", msg[1]))
            self.on_done(w.batch)
            w.batch = None
        elif kind == "done":
            self.on_done(w.batch)
            w.batch, w.deadline = None, None

    def _lost(self, w: _Worker, queue, status: str, why: str) -> _Worker:
        """Report the case (or batch) the dead worker held, requeue the rest of its batch, replace it."""
        stack = w.stack()
        detail = f"{why}\n{stack}" if stack else why
        if w.current is not None:
            index, res = w.current
            res = dict(res, status=status, message=detail)
            self.sink(res)
            resume = index + 1
        elif w.total is None:
            self.sink(_batch_result(w.batch, status, detail))
            resume = None
        else:
            resume = w.next_index
        if resume is not None and w.total is not None and resume < w.total:
            queue.appendleft(replace(w.batch, start=resume))
        else:
            self.on_done(w.batch)
        w.batch = None
        w.stop(kill=True)
        self.restarts += 1
        return _Worker(self.setup)

    def _abandon(self, queue, workers):
        reason = f"not run: more than {self.restart_cap} worker restarts"
        for b in list(queue) + [w.batch for w in workers if w.batch is not None]:
            self.sink(_batch_result(b, "error", reason))
            self.on_done(b)
        queue.clear()


def _death(exitcode) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"worker process died with {name}"
    return f"worker process exited with code {exitcode}"


def _batch_result(batch: Batch, status: str, message: str) -> dict:
    """A result standing for a whole batch that could not be built or run."""
    from opport.conformance.execute import direction

    return {"id": f"{batch.key}/<batch>", "op": batch.op, "direction": direction(batch.op), "backend": batch.backend,
            "kernel": "", "dtype": batch.dtype,
            "case": "<batch>", "source": "batch", "layout": None, "tags": [], "status": status, "metrics": {},
            "message": message, "worst": None}
