"""glibc's heap kept for the kernels' temporaries: a pad of free memory at the heap's top (mallopt M_TOP_PAD).

A kernel makes score blocks, accumulators and outputs of 0.1-4 MB and frees them before it returns. glibc gives
memory at the heap's top back to the system once more than 128 KB of it is free (its trim threshold), so the next
call's arrays fault their pages in again, zeroed by the kernel: on the 2-core VM a tiny Llama's attention forward
[4, 4, 128, 64] spent 0.8 of its 2.1 ms in page faults (293 a call), its backward 1.1 of 4.0 ms. With a 64 MiB pad
glibc keeps that much free memory when it trims and grows the heap by as much at once: 1.2 and 2.9 ms. torch's own
CPU tensors come from the same malloc and gain the same (docs/cpu.md, "Memory"). Arrays of 32 MiB and more are
mapped for themselves, as glibc does by default at its largest threshold (MMAP_THRESHOLD).

Set once, when the cpu kernels load, for the whole process: `OPPORT_MALLOC_TOP_PAD` (bytes; 0 leaves glibc as it
is). Left alone where the user tuned glibc's malloc already (MALLOC_TOP_PAD_, MALLOC_TRIM_THRESHOLD_,
MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES naming malloc), and where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os

from opport.errors import ArgumentError

TOP_PAD = 64 << 20  # the default pad, bytes: a few of the largest blocks the kernels make (SCORE_BUDGET is 4 MB)
# Setting any of glibc's thresholds freezes the mmap threshold, which glibc otherwise raises to the size of each
# mmapped block freed (up to 32 MiB): frozen at its initial 128 KB, every larger array the heap's free top cannot
# hold is mmapped and faulted in anew (torch's 14 MB gelu temporaries: the cpu bench's system time 15 -> 44 s).
# So the threshold is set to that 32 MiB ceiling, where glibc's own adjustment would end.
MMAP_THRESHOLD = 32 << 20
_M_TOP_PAD, _M_MMAP_THRESHOLD = -2, -3  # glibc's malloc.h
_USER_KNOBS = ("MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
state = "not set"  # what keep() did, for `opport doctor`


def _requested(environ) -> int:
    raw = environ.get("OPPORT_MALLOC_TOP_PAD", "").strip()
    if not raw:
        return TOP_PAD
    if not raw.isdigit():
        raise ArgumentError(op="cpu", arg="OPPORT_MALLOC_TOP_PAD", constraint="cpu.malloc_top_pad",
                            expected="a number of bytes (0: leave glibc's malloc as it is)", got=repr(raw))
    return int(raw)


def keep() -> str:
    """Ask glibc for the pad (once a process: later calls return what the first did)."""
    global state
    if state != "not set":
        return state
    pad, state = decide(os.environ, _glibc())
    if pad:
        libc = ctypes.CDLL(None)
        if not (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TOP_PAD, pad) == 1):
            state = "mallopt refused the pad"
    return state


def decide(environ, glibc: bool) -> tuple:
    """(the pad to set, 0 for none; what that means, for `state`) for an environment."""
    pad = _requested(environ)
    if pad == 0:
        return 0, "off (OPPORT_MALLOC_TOP_PAD=0)"
    if any(k in environ for k in _USER_KNOBS) or "malloc" in environ.get("GLIBC_TUNABLES", ""):
        return 0, "left as the environment sets it"
    if not glibc:
        return 0, "not glibc: left alone"
    return pad, f"top pad {pad / 2**20:g} MiB, mmap threshold 32 MiB"


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")  # a look-up; platform.libc_ver reads a file
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or a libc that does not know the name
        return False
