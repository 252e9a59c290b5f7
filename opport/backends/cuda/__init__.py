"""cuda backend: Triton kernels on torch tensors.

Modes: `compiled` when torch sees a CUDA device (kernels JIT-compile for the GPU), else `interpreter`
(Triton's NumPy interpreter on CPU tensors, how CI runs it). Triton reads TRITON_INTERPRET when a
`@triton.jit` function is *defined*, so `setup()` fixes the mode and the variable before any kernel
module is imported; every kernel module calls it first (through `_launch`). If triton was imported
earlier, `setup()` re-wraps triton's own jit-defined library for the interpreter. Importing this
package imports neither torch nor triton. See docs/cuda.md.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading

from opport.dispatch.registry import Backend, Capabilities

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
                    if "triton.language" in sys.modules:  # imported before the variable was set
                        _reinterpret_stdlib()
                    _mode = "interpreter"
                else:
                    _mode = "compiled"
    return _mode


def compile_only() -> None:
    """Define the kernels as compiled JIT functions on a machine with no GPU, for tools/cuda_aot.py.

    Nothing can launch in such a process: the tool installs a driver that only compiles. Must run
    before any kernel module is imported; a process that already chose the interpreter cannot switch.
    """
    global _mode
    with _lock:
        if _mode == "compiled":
            return
        if _mode == "interpreter" or "opport.backends.cuda._launch" in sys.modules:
            raise RuntimeError("the cuda kernels were already imported for the interpreter; compile in a fresh process")
        os.environ.pop("TRITON_INTERPRET", None)
        _mode = "compiled"


def _probe() -> str | None:
    for mod in ("torch", "triton"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    try:
        mode = setup()  # before importing triton where possible: its standard library is jit-defined at import
        import triton.language as tl
    except Exception as e:  # a broken install (ABI mismatch, missing libs) means "cannot run"
        return f"importing torch/triton failed: {type(e).__name__}: {e}"
    if mode == "interpreter" and not _interpreted(tl):
        return "triton was imported before TRITON_INTERPRET=1 was set and its standard library could not be re-wrapped"
    return None


def _interpreted(tl) -> bool:
    return type(tl.sum).__name__ == "InterpretedFunction"


def _reinterpret_stdlib():
    """Re-wrap triton.language's jit-defined functions (tl.sum, tl.max, ...) for the interpreter.

    Triton decides compiled-vs-interpreted when a @triton.jit function is defined, so if the process
    imported triton before opport chose interpreter mode (torch.compile does, for one), those library
    functions are compiled-mode objects the interpreter cannot call. With no GPU in this process
    nothing can run them compiled anyway, so they are swapped for the interpreted wrappers that
    importing triton under TRITON_INTERPRET=1 would have made.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict = {}
    for name, mod in list(sys.modules.items()):
        if mod is not None and name.startswith("triton.language"):
            for attr, value in list(vars(mod).items()):
                if isinstance(value, JITFunction):
                    setattr(mod, attr, wrapped.setdefault(id(value), InterpretedFunction(value.fn)))


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
    serialized=lambda: setup() == "interpreter",  # the interpreter patches triton.language while it runs
    capabilities=Capabilities(
        emulated=lambda: setup() == "interpreter",
        max_workers=lambda: 4 if setup() == "compiled" else None,  # each worker holds a CUDA context on one GPU
        bench=f"{__name__}.bench",
        device_resource="GPU",  # Ray's name for the GPUs a node offers (num_gpus)
    ),
)
