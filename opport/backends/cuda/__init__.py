"""cuda backend: Triton kernels on torch tensors.

Modes: `compiled` when torch sees a CUDA device (kernels JIT-compile for the GPU), else `interpreter`
(Triton's NumPy interpreter on CPU tensors, how CI runs it). Triton reads TRITON_INTERPRET when a
`@triton.jit` function is *defined*, so `setup()` fixes the mode and the variable before any kernel
module is imported; every kernel module calls it first (through `_launch`). Importing this package
imports neither torch nor triton.
"""

from __future__ import annotations

import importlib.util
import os
import threading

from opport.dispatch.registry import Backend

_lock = threading.Lock()
_mode: str | None = None


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() not in ("", "0", "false", "no")


def setup() -> str:
    """Decide the mode once ("compiled" or "interpreter") and set TRITON_INTERPRET to match."""
    global _mode
    if _mode is None:
        with _lock:
            if _mode is None:
                import torch

                if _interpret_requested() or not torch.cuda.is_available():
                    os.environ["TRITON_INTERPRET"] = "1"
                    _mode = "interpreter"
                else:
                    _mode = "compiled"
    return _mode


def _probe() -> str | None:
    for mod in ("torch", "triton"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    try:
        mode = setup()  # before importing triton: its standard library is jit-defined at import
        import triton.language as tl
    except Exception as e:  # a broken install (ABI mismatch, missing libs) means "cannot run"
        return f"importing torch/triton failed: {type(e).__name__}: {e}"
    if mode == "interpreter" and type(tl.sum).__name__ != "InterpretedFunction":
        return ("triton was imported before opport enabled its interpreter (no GPU here); "
                "set TRITON_INTERPRET=1 before importing triton")
    return None


def _versions() -> dict:
    import torch
    import triton

    v = {"torch": torch.__version__, "triton": triton.__version__}
    if setup() == "compiled":
        v["cuda"] = torch.version.cuda
        v["device"] = torch.cuda.get_device_name()
    return v


BACKEND = Backend(
    name="cuda",
    package=__name__,
    array_kind="torch",
    device_types=("cuda",),
    dtypes=("float32", "float16", "bfloat16"),
    probe=_probe,
    mode=setup,
    versions=_versions,
    hint="pip install 'opport[cuda]'",
    torch_device=lambda: "cuda" if setup() == "compiled" else "cpu",
)
