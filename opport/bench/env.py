"""What every report records about where it ran: package versions and the host (a backend's bench module
records its own device: opport/bench/profile.py)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

_PACKAGES = ("opport", "numpy", "ml_dtypes", "torch", "triton", "jax", "matplotlib", "scipy")


def versions() -> dict:
    """Python's and the packages' versions (a backend adds its own through `Backend.versions`)."""
    v = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            v[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return v


def host() -> dict:
    """The machine the command runs on (the `--overhead` report's device: dispatch runs on the host)."""
    info = {"kind": "host", "name": platform.processor() or platform.machine(), "logical_cpus": os.cpu_count()}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["threads"] = {"torch": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    except OSError:
        names = []
    if names:
        info["name"] = names[0]
    return info
