"""Building torch_native.cpp (the native autograd nodes, opport/integrations/torch_native.py): torch and the standard
library only, so that `make venv` can compile it (through runpy: run as `python <file>`, its folder's torch.py would
shadow torch) while uv still installs the rest of opport's dependencies."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("torch_native.cpp")
CFLAGS = ["-O2", "-fopenmp"]  # at::parallel_for is OpenMP pragmas in headers: without it, one thread
LDFLAGS = ["-fopenmp"]  # DT_NEEDED libgomp.so.1: the loader binds torch's own copy, loaded first (one thread pool)


def module_name() -> str:
    """The extension's name: its source, flags and torch's version hashed (a changed source is another module)."""
    h = hashlib.sha256(SOURCE.read_bytes() + repr((CFLAGS, LDFLAGS, torch.__version__, sys.version_info[:2])).encode())
    return f"opport_torch_native_{h.hexdigest()[:16]}"


def library_path() -> Path:
    """Where the built extension is (torch's extension directory, TORCH_EXTENSIONS_DIR; made if missing)."""
    from torch.utils.cpp_extension import _get_build_directory

    name = module_name()
    return Path(_get_build_directory(name, verbose=False)) / f"{name}.so"


def build(verbose: bool = False) -> Path:
    """Compile the extension (torch.utils.cpp_extension, ninja) if it is not built yet; returns its path."""
    from torch.utils.cpp_extension import load

    path = library_path()
    if not path.exists():
        bin_dir = str(Path(sys.executable).parent)  # a venv's own ninja (pip's), found by torch on PATH
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
        # copies: torch's load() appends its own -L/-l flags to the lists it is given, which would change module_name()
        load(module_name(), [str(SOURCE)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), verbose=verbose)
    return path


if __name__ == "__main__":
    print(f"opport torch_native: built {build(verbose='--verbose' in sys.argv[1:])}")
