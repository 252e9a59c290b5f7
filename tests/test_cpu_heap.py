"""The cpu kernels' temporaries keep their pages: glibc's top pad (opport/backends/cpu/_heap.py)."""

import os
import resource
import subprocess
import sys

import numpy as np
import pytest

from opport.backends.cpu import _heap
from opport.backends.cpu import attention as cpu_attention
from opport.errors import ArgumentError

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


def test_the_environment_decides_the_pad():
    assert _heap.decide({}, True) == (64 << 20, "top pad 64 MiB, mmap threshold 32 MiB")
    assert _heap.decide({"OPPORT_MALLOC_TOP_PAD": "8388608"}, True) == (8 << 20, "top pad 8 MiB, mmap threshold 32 MiB")
    assert _heap.decide({"OPPORT_MALLOC_TOP_PAD": "0"}, True) == (0, "off (OPPORT_MALLOC_TOP_PAD=0)")
    for env in ({"MALLOC_TOP_PAD_": "1048576"}, {"MALLOC_MMAP_THRESHOLD_": "1"},
                {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}):
        assert _heap.decide(env, True) == (0, "left as the environment sets it")
    assert _heap.decide({}, False) == (0, "not glibc: left alone")
    with pytest.raises(ArgumentError, match="OPPORT_MALLOC_TOP_PAD"):
        _heap.decide({"OPPORT_MALLOC_TOP_PAD": "lots"}, True)


@pytest.mark.skipif(not GLIBC, reason="mallopt's top pad is glibc's")
def test_the_pad_is_set_when_the_kernels_load_not_on_import_and_a_bad_one_fails_the_call():
    code = ("import sys, numpy as np, opport; assert 'opport.backends.cpu._heap' not in sys.modules; "
            "opport.rmsnorm(np.ones((2, 4), np.float32), np.ones(4, np.float32)); "
            "from opport.backends.cpu import _heap; print(_heap.state)")
    assert _run(code).stdout.strip() == "top pad 64 MiB, mmap threshold 32 MiB"
    r = _run(code, OPPORT_MALLOC_TOP_PAD="lots")
    assert r.returncode != 0
    assert "ArgumentError" in r.stderr and "OPPORT_MALLOC_TOP_PAD" in r.stderr and "'lots'" in r.stderr


def test_doctor_reports_the_pad_and_a_bad_value_without_raising(monkeypatch):
    from opport.doctor import cpu_heap_line

    assert cpu_heap_line().endswith(_heap.state if _heap.state != "not set" else _heap.decide(os.environ, GLIBC)[1])
    monkeypatch.setattr(_heap, "state", "not set")  # as in a process whose kernels have not loaded
    monkeypatch.setenv("OPPORT_MALLOC_TOP_PAD", "lots")
    line = cpu_heap_line()
    assert "error" in line and "OPPORT_MALLOC_TOP_PAD" in line and "'lots'" in line
