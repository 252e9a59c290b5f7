"""What every report records about where it ran: versions, device, clocks (read-only queries)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

_PACKAGES = ("opport", "numpy", "ml_dtypes", "torch", "triton", "jax", "matplotlib", "scipy")


def versions() -> dict:
    v = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            v[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
        v["cudnn"] = torch.backends.cudnn.version()
    return v


def cpu_device() -> dict:
    from opport.backends.cpu._common import num_threads

    info = {"kind": "cpu", "name": platform.processor() or platform.machine(), "logical_cpus": os.cpu_count(),
            "threads": {"opport": num_threads()}}  # the cpu kernels' pool (OPPORT_NUM_THREADS)
    torch = sys.modules.get("torch")
    if torch is not None:
        info["threads"]["torch"] = torch.get_num_threads()  # torch CPU eager's intra-op threads
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
        mhz = [float(ln.split(":", 1)[1]) for ln in lines if ln.startswith("cpu MHz")]
        if names:
            info["name"] = names[0]
        if mhz:
            info["clocks"] = {"cpu_MHz_mean": round(sum(mhz) / len(mhz), 1)}
    except OSError:
        pass
    return info


_SMI_FIELDS = ("driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.draw",
               "power.limit", "temperature.gpu", "pstate")


def gpu_clocks() -> dict:
    """nvidia-smi's current clocks, power and temperature (a query only: nothing is set)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"note": "nvidia-smi not found; clocks not readable"}
    try:
        out = subprocess.run([smi, f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return {"note": f"nvidia-smi failed: {e}"}
    vals = [x.strip() for x in out.split(",")]
    return dict(zip(_SMI_FIELDS, vals)) if len(vals) == len(_SMI_FIELDS) else {"note": f"unparsed: {out[:200]}"}


def cuda_device() -> dict:
    import torch

    idx = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(idx)
    return {"kind": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
            "l2_MiB": round(getattr(p, "L2_cache_size", 0) / 2**20, 1), "memory_GiB": round(p.total_memory / 2**30, 1),
            "clocks_start": gpu_clocks()}
