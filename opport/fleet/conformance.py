"""`opport conformance --cluster ...`: conformance batches as Ray tasks.

Each batch (one op x backend x dtype, or one op's bad inputs) is one task: a generator that streams what the
local worker sends (opport/conformance/worker.py `batch_messages`): each case announced before it runs, its
result after. To keep the driver's work per case small (docs/fleet.md), a task sends its messages in
bundles, at most every FLUSH_S; when such a task dies or hangs, the driver cannot know which case did it,
so it runs the rest of the batch again in exact mode (every message sent at once), which names the case
as the local pool does.
A task needs one CPU plus the backend's device resource where the cluster offers it (cluster.requirement):
compiled cuda lands on GPU nodes, neuron hardware on `neuron_cores` nodes, cpu and emulated runs anywhere.

Faults: a task whose worker dies (segfault, abort, OOM kill) makes its running case `crash`, and the rest of
the batch is submitted again; a case past its time limit is cancelled and `timeout`; a lost node's unfinished
cases are resubmitted if an alive node has the resources, else reported `lost` with the reason; Ctrl-C
cancels every task, reports the cases not run as `lost` and still returns the (partial) report.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from opport.conformance.runner import Executed
from opport.conformance.worker import ENUMERATE_TIMEOUT, Batch, _batch_result, build_items
from opport.fleet.cluster import alive_nodes, connect, offered, requirement, task_options
from opport.fleet.host import HostBook

POLL_S = 0.25  # how often deadlines and tasks no node can take are checked, at most
FEASIBLE_EVERY_S = 2.0  # how often pending tasks are checked against the alive nodes' resources
EXIT_GRACE_S = 1.0  # a worker left with a poisoned device lets its last result reach the driver, then exits
# a task sends its messages at most this often (the first ones, the count and the end at once): one message
# a case costs the driver ~0.13 ms, the floor of its throughput at 64 hosts (docs/fleet.md)
FLUSH_S = 0.2
URGENT = ("count", "batch_error", "done", "exit")  # sent at once, also in bundled mode


def run(options, display, address: str, dashboard: bool = False):
    """runner.run on a cluster: connect (or start Ray here), run every batch as a task, return the Report."""
    from opport.conformance.runner import run as run_suite

    with connect(address, dashboard=dashboard, num_cpus=options.workers or None) as ray:
        return run_suite(options, display, Executor(ray, options))


def batch_task(batch: Batch, setup: tuple, flush_s: float):
    """The Ray task: lists of messages, first [("hello", node id, doctor record)], then the batch's, run on
    this host; `flush_s` 0 sends each message alone (exact mode)."""
    from opport.conformance.worker import batch_messages
    from opport.dispatch import get_backend
    from opport.fleet.host import here

    node, record = here(batch.backend, setup)
    yield [("hello", node, record)]
    emulated = get_backend(batch.backend).capabilities.emulated()  # this host's mode sets the tier's caps
    pending, sent = [], time.monotonic()
    for msg in batch_messages(replace(batch, sel=replace(batch.sel, emulated=emulated))):
        pending.append(msg)
        if msg[0] in URGENT or time.monotonic() - sent >= flush_s:
            yield pending
            pending, sent = [], time.monotonic()
        if msg[0] == "exit":
            time.sleep(EXIT_GRACE_S)
            os._exit(3)  # Ray replaces this worker process; the driver resubmits the rest of the batch
    if pending:
        yield pending


@dataclass(eq=False)
class _Task:
    batch: Batch
    gen: object  # ray.ObjectRefGenerator
    need: dict
    next_index: int
    node: str | None = None  # where it runs, once it said hello
    host: str | None = None
    current: tuple | None = None  # (index, skeleton result) of the case running
    total: int | None = None
    deadline: float | None = None
    first_case: bool = True  # the first case of a task may compile (--compile-timeout)
    exact: bool = False  # each message sent alone: a death or hang names its case


class Executor:
    """Runs the plan's batches on the connected cluster (the runner's `execute`)."""

    def __init__(self, ray, options):
        self.ray, self.options = ray, options
        self.remote = ray.remote(batch_task)
        self.book = HostBook(alive_nodes(ray))
        self.needs: dict = {}  # backend -> resources its tasks need, fixed at the start of the run
        self.running: list = []
        self.restarts = 0
        self.restart_cap = 4 * max(1, int(ray.cluster_resources().get("CPU", 1)))  # as the local pool's 4 x workers

    def __call__(self, batches, sink, on_count, on_done) -> Executed:
        self.sink, self.on_count, self.on_done = sink, on_count, on_done
        try:
            self.running = [self._submit(b) for b in batches]
            next_check = time.monotonic() + FEASIBLE_EVERY_S
            while self.running:
                self._step()
                if time.monotonic() > next_check:
                    self._drop_infeasible()
                    next_check = time.monotonic() + FEASIBLE_EVERY_S
                if self.restarts > self.restart_cap:
                    self._stop_all("error", f"not run: more than {self.restart_cap} worker restarts")
        except KeyboardInterrupt:
            self._stop_all("lost", "interrupted (Ctrl-C) before it ran")
            return Executed(self.book.records, interrupted=True)
        return Executed(self.book.records)

    def _submit(self, batch: Batch, exact: bool = False) -> _Task:
        need = self.needs.setdefault(batch.backend, requirement(batch.backend, self.ray))
        opts = task_options(need)
        flush = 0.0 if exact else FLUSH_S
        gen = self.remote.options(max_retries=0, **opts).remote(batch, tuple(self.options.setup), flush)
        return _Task(batch, gen, need, next_index=batch.start, exact=exact)

    def _step(self):
        gens = [t.gen for t in self.running]
        self.ray.wait(gens, num_returns=1, timeout=POLL_S)
        ready, _ = self.ray.wait(gens, num_returns=len(gens), timeout=0)
        ready_ids = {id(g) for g in ready}
        for t in [t for t in self.running if id(t.gen) in ready_ids]:
            self._drain(t)
        now = time.monotonic()
        for t in [t for t in self.running if t.deadline is not None and now > t.deadline]:
            self._timeout(t)

    def _drain(self, t: _Task):
        """Handle every message `t` has ready, and its end or failure."""
        while t in self.running and self.ray.wait([t.gen], timeout=0)[0]:
            try:
                msgs = self.ray.get(next(t.gen))
            except StopIteration:
                self._finish(t)
                return
            except self.ray.exceptions.RayError as e:
                self._failed(t, e)
                return
            for msg in msgs:
                self._message(t, msg)
            if not t.exact and t in self.running and t.total is not None:  # the case running is unknown: time
                extra = self.options.compile_timeout if t.first_case else 0.0  # the silence instead
                t.deadline = time.monotonic() + self.options.timeout + extra + FLUSH_S

    def _message(self, t: _Task, msg: tuple):
        kind = msg[0]
        if kind == "hello":
            t.node, t.host = msg[1], self.book.add(msg[1], msg[2])
            t.deadline = time.monotonic() + ENUMERATE_TIMEOUT
        elif kind == "count":
            t.total = msg[1]
            self.on_count(max(0, msg[1] - t.batch.start))
        elif kind == "start":
            t.current = (msg[1], dict(msg[2], host=t.host))
            extra = self.options.compile_timeout if t.first_case else 0.0
            t.deadline = time.monotonic() + self.options.timeout + extra
        elif kind == "result":
            t.current, t.next_index, t.deadline, t.first_case = None, msg[1] + 1, None, False
            self.sink(dict(msg[2], host=t.host))
        elif kind == "batch_error":
            self.sink(dict(_batch_result(t.batch, "error", msg[1]), host=t.host))
            self._finish(t)
        elif kind == "done":
            self._finish(t)
        # "exit": the worker ends itself next; its death resumes the batch after the case it reported

    def _finish(self, t: _Task):
        if t in self.running:
            self.running.remove(t)
            self.on_done(t.batch)

    def _failed(self, t: _Task, e: Exception):
        self.running.remove(t)
        why = f"{type(e).__name__}: {_first_line(e)}"
        if isinstance(e, self.ray.exceptions.NodeDiedError) or (t.node and t.node not in self._alive()):
            self._move_or_lose(t, f"node {t.host or t.node or '?'} was lost ({why})")
        elif isinstance(e, self.ray.exceptions.RayTaskError):  # opport's own code failed there (setup, imports)
            self.sink(dict(_batch_result(t.batch, "error", f"on {t.host}: {e}"), host=t.host))
            self.on_done(t.batch)
        elif not self._again_exact(t):  # the worker died: a segfault, abort, OOM kill (WorkerCrashedError, ...)
            self.restarts += 1
            self._lose_case(t, "crash", f"worker process on {t.host or 'its node'} died: {why}")

    def _timeout(self, t: _Task):
        self._cancel(t)
        self.running.remove(t)
        if not self._again_exact(t):
            limit = "case" if t.current else "building the batch"
            self._lose_case(t, "timeout", f"{limit} exceeded its time limit on {t.host}; task cancelled")

    def _again_exact(self, t: _Task) -> bool:
        """A bundled task that died or hung past its enumeration: run the rest again, each message sent alone,
        to learn which case it was (True); False when the task was exact already."""
        if t.exact or t.total is None:
            return False
        if t.next_index < t.total:
            self.running.append(self._submit(replace(t.batch, start=t.next_index), exact=True))
        else:
            self.on_done(t.batch)
        return True

    def _lose_case(self, t: _Task, status: str, why: str):
        """The running case (or the whole batch, if none started) gets `status`; the rest is resubmitted."""
        if t.current is not None:
            index, res = t.current
            self.sink(dict(res, status=status, message=why))
            resume = index + 1
        elif t.total is None:
            self.sink(dict(_batch_result(t.batch, status, why), host=t.host))
            resume = None
        else:
            resume = t.next_index
        if resume is not None and t.total is not None and resume < t.total:
            self.running.append(self._submit(replace(t.batch, start=resume)))
        else:
            self.on_done(t.batch)

    def _move_or_lose(self, t: _Task, why: str):
        """A lost node's batch: resume it elsewhere from its unfinished case, or report what it had left lost."""
        start = t.next_index if t.total is not None else t.batch.start  # the first case without a result
        if offered(self.ray, t.need):
            self.running.append(self._submit(replace(t.batch, start=start)))
        else:
            self._lose_rest(t.batch, start, f"{why}; no alive node offers {t.need or 'a CPU'}", t.host)

    def _lose_rest(self, batch: Batch, start: int, why: str, host: str | None):
        """Every case of `batch` from `start` as `lost` (one row per case: the report never misses one)."""
        from opport.conformance.execute import new_result

        try:
            items = build_items(batch)
        except Exception as e:  # the cases cannot be built here: one row stands for the batch
            self.sink(dict(_batch_result(batch, "lost", f"{why} (its cases could not be listed: {e})"), host=host))
        else:
            for i in range(start, len(items)):
                self.sink(dict(new_result(items[i]), index=i, status="lost", message=why, host=host))
        self.on_done(batch)

    def _drop_infeasible(self):
        """Tasks not started whose resources no alive node offers any more (Ray would keep them pending)."""
        for t in [t for t in self.running if t.node is None and not offered(self.ray, t.need)]:
            self._cancel(t)
            self.running.remove(t)
            self._lose_rest(t.batch, t.batch.start, f"no alive node offers {t.need}", None)

    def _stop_all(self, status: str, why: str):
        """Cancel every task; the running case of each and the rest of its batch get `status`."""
        for t in self.running:
            self._cancel(t)
        for t in self.running:
            if t.current is not None:
                self.sink(dict(t.current[1], status=status, message=why))
            rest = t.current[0] + 1 if t.current else t.next_index
            if t.total is None or rest < t.total:
                row = _batch_result(replace(t.batch, start=rest), status, f"{why} (cases from #{rest} of the batch)")
                self.sink(dict(row, host=t.host))
            self.on_done(t.batch)
        self.running = []

    def _cancel(self, t: _Task):
        try:
            self.ray.cancel(t.gen, force=True)
        except Exception:  # already finished or its node gone: nothing left to cancel
            pass

    def _alive(self) -> set:
        return {node for node, _, _ in alive_nodes(self.ray)}


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
