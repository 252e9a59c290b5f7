"""The cpu kernels' temporaries keep their pages: glibc's top pad (opport/backends/cpu/_heap.py)."""

import os
import resource
import subprocess
import sys

import numpy as np
import pytest

from opport.backends.cpu import _heap
from opport.backends.cpu import attention as cpu_attention

GLIBC = _heap._glibc()


def _run(code: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "OPPORT_MALLOC"))}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not GLIBC, reason="mallopt's top pad is glibc's")
def test_repeated_kernel_calls_fault_no_pages_in():
    """A tiny Llama's attention forward made 293 page faults a call without the pad (its 0.1-0.5 MB score blocks
    and output given back to the system and faulted in again); with it, none once warm."""
    assert _heap.state.startswith("top pad"), _heap.state
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s, np.float32) for s in ((4, 4, 128, 64), (4, 2, 128, 64), (4, 2, 128, 64)))
    for _ in range(3):
        cpu_attention.attention_forward(q, k, v, True, None)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(20):
        cpu_attention.attention_forward(q, k, v, True, None)
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < 100, f"{faults} page faults in 20 calls"


@pytest.mark.skipif(not GLIBC, reason="mallopt's top pad is glibc's")
def test_the_pad_is_set_once_the_kernels_load_and_the_environment_decides():
    code = "from opport.backends.cpu import _common, _heap; print(_heap.state)"
    assert _run(code).stdout.strip() == "top pad 64 MiB, mmap threshold 32 MiB"
    assert _run(code, OPPORT_MALLOC_TOP_PAD="8388608").stdout.strip() == "top pad 8 MiB, mmap threshold 32 MiB"
    assert _run(code, OPPORT_MALLOC_TOP_PAD="0").stdout.strip() == "off (OPPORT_MALLOC_TOP_PAD=0)"
    assert _run(code, MALLOC_TOP_PAD_="1048576").stdout.strip() == "left as the environment sets it"
    assert _run(code, GLIBC_TUNABLES="glibc.malloc.trim_threshold=1").stdout.strip() == "left as the environment sets it"
    # importing opport alone changes nothing: the pad comes with the cpu kernels
    assert _run("import opport, sys; print('opport.backends.cpu._heap' in sys.modules)").stdout.strip() == "False"


def test_a_bad_pad_is_an_argument_error_naming_the_variable():
    r = _run("import numpy as np, opport; opport.rmsnorm(np.ones((2, 4), np.float32), np.ones(4, np.float32))",
             OPPORT_MALLOC_TOP_PAD="lots")
    assert r.returncode != 0
    assert "ArgumentError" in r.stderr and "OPPORT_MALLOC_TOP_PAD" in r.stderr and "'lots'" in r.stderr
