"""A deliberately faulty backend for the isolation self-test (docs/numerics.md G5).

`faulty` runs the cpu rmsnorm kernel, except on a few fixed cases, recognised by x's shape:

    row-127 (5, 127)   os.abort()                       -> crash
    row-128 (5, 128)   sleeps forever                   -> timeout
    row-129 (5, 129)   reads address 0 (SIGSEGV)        -> crash
    row-1   (7, 1)     raises a CUDA "illegal memory access" error, which poisons a device -> crash

Every other case must still pass, in one complete report.
"""

from __future__ import annotations

import ctypes
import os
import time

FAULTS = {(5, 127): "abort", (5, 128): "hang", (5, 129): "segfault", (7, 1): "sticky"}
EXPECTED = {"row-127": "crash", "row-128": "timeout", "row-129": "crash", "row-1": "crash", "odd-3d": "pass",
            "no-weight": "pass"}


def install():
    from opport.dispatch import Backend, backends, get_backend, impl, kernels, register_backend
    from opport.ops import get_op

    if "faulty" in backends():
        return
    register_backend(Backend(name="faulty", package="opport.conformance", array_kind="numpy", device_types=(),
                             dtypes=("float32",), probe=lambda: None, mode=lambda: "faulty"))
    spec = get_op("rmsnorm")
    cpu = kernels(spec, get_backend("cpu"))[0]

    @impl(spec, "faulty", dtypes=("float32",), name="faulty.rmsnorm")
    def rmsnorm(x, weight, eps, offset=0.0):
        fault = FAULTS.get(tuple(x.shape))
        if fault == "abort":
            os.abort()
        if fault == "hang":
            while True:
                time.sleep(1)
        if fault == "segfault":
            ctypes.string_at(0)
        if fault == "sticky":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return cpu.fn(x, weight, eps, offset)


def uninstall():
    from opport.dispatch import unregister_backend

    unregister_backend("faulty")  # and its kernel
