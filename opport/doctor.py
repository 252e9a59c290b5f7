"""What `opport doctor` reports, as data: each backend's status, mode and versions, and the host they run on.

The same record heads every conformance and bench report (`"hosts"`), one per machine of the run, so a
result row can always be traced to the hardware, drivers and backend modes that produced it.
"""

from __future__ import annotations

import os
import platform
import socket
import sys


def backend_status(names=None) -> dict:
    """{backend: {"mode", "versions", "unavailable", "hint"}} for the named backends (default: every one known
    here); probes each once."""
    from opport.dispatch import backends, get_backend

    out = {}
    for b in backends().values() if names is None else [get_backend(n) for n in names]:
        why = b.unavailable()
        out[b.name] = {"mode": None if why else b.mode(), "versions": {} if why else _versions(b), "unavailable": why,
                       "hint": b.hint}
    return out


def _versions(b) -> dict:
    try:
        return b.versions()
    except Exception as e:  # versions are informative: a failing query must not hide the backend
        return {"error": f"{type(e).__name__}: {e}"}


def host_record(names=None) -> dict:
    """This machine: hostname, CPU, accelerator, and the modes and versions of the named backends (default: all)
    as `opport doctor` shows them. A run records only its own backends: probing another one imports its kernel
    modules, and Hypothesis mixes constants from every imported local module into its draws, so the cases
    of the run would depend on what was probed."""
    status = backend_status(names)
    return {"hostname": socket.gethostname(), "platform": f"{platform.system()} {platform.release()}",
            "machine": platform.machine(), "python": platform.python_version(), "logical_cpus": os.cpu_count(),
            "cpu": _cpu_name(), "accelerator": accelerator(status),
            "backends": {n: {k: v for k, v in s.items() if k != "hint"} for n, s in status.items()}}


def accelerator(status: dict) -> str:
    """The devices the backends in `status` run on for real here (not emulated), e.g. "NVIDIA H200"; "cpu" if
    none. Which backends drive a device is each backend's `Capabilities.device_resource`."""
    from opport.dispatch import backends

    found = []
    for name, s in status.items():
        b = backends().get(name)
        if b is None or s["unavailable"] or not b.capabilities.device_resource or b.capabilities.emulated():
            continue
        found.append(str(s["versions"].get("device") or f"{name} ({s['mode']})"))
    return ", ".join(found) or "cpu"


def merged(record: dict, other: dict) -> dict:
    """One host's record from two that each name some of its backends (a cluster host that ran several)."""
    backends = {**record["backends"], **other["backends"]}
    out = {**record, "backends": backends}
    devices = [d for d in (record["accelerator"], other["accelerator"]) if d != "cpu"]
    out["accelerator"] = ", ".join(dict.fromkeys(x for d in devices for x in d.split(", "))) or "cpu"
    return out


def host_kind(record: dict) -> str:
    """What groups hosts into one report column: the accelerator (two H200 hosts are one kind)."""
    return record.get("accelerator") or "cpu"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def python_line() -> str:
    return f"python {platform.python_version()} on {platform.machine()} ({sys.platform})"


def cpu_heap_line() -> str:
    """glibc's top pad for the cpu kernels' temporaries (opport/backends/cpu/_heap.py): what was set if the kernels
    have loaded, else what they would set. Only reads: doctor changes no malloc setting, and a bad
    OPPORT_MALLOC_TOP_PAD is reported here, not raised (the kernels raise it)."""
    from opport.backends.cpu import _heap
    from opport.errors import ArgumentError

    try:
        state = _heap.state if _heap.state != "not set" else _heap.decide(os.environ, _heap._glibc())[1]
    except ArgumentError as e:
        state = f"error: {e}"
    return f"cpu kernels' heap (glibc malloc, OPPORT_MALLOC_TOP_PAD): {state}"


def torch_native_line() -> str | None:
    """Whether small float32 calls on torch CPU tensors run natively here (opport/integrations/torch_native.py):
    training calls of silu, swiglu, layernorm, rmsnorm, add_rmsnorm, rope and attention as autograd nodes, calls
    without gradients of those (attention's decode steps) as plain forwards; None where torch is not installed."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    from opport.integrations import torch_native

    return (f"torch native autograd nodes (cpu: silu, swiglu, layernorm, rmsnorm, add_rmsnorm, rope, attention): "
            f"{torch_native.status()}")
