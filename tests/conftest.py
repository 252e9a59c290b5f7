"""Shared fixtures: a throwaway backend whose kernels a test registers by hand; real runs in a results store."""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest

# A fresh inductor cache per run: a cache left by an earlier build of a fake kernel can replay stale code.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="opport-inductor-"))
# Models are built from configs (nothing is downloaded): any Hugging Face Hub call fails at once instead of waiting
# on a network a CI machine may not have (transformers, TRL and datasets read these before their first request).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from opport.dispatch import Backend, register_backend, unregister_backend
from opport.dtypes import FLOATS


@contextlib.contextmanager
def fake_backend(name: str, probe=lambda: None, device_types=("fakedev",), array_kind="numpy"):
    """A backend named `name` with no kernels of its own; kernels registered on it are removed after."""
    b = Backend(name=name, package=f"_opport_test_backends.{name}", array_kind=array_kind,
                device_types=device_types, dtypes=FLOATS, probe=probe, mode=lambda: "test")
    register_backend(b)
    try:
        yield b
    finally:
        unregister_backend(name)  # and its kernels


@pytest.fixture
def backend_factory():
    return fake_backend


def pytest_configure(config):
    """Probe the backends before any test imports triton by another route (transformers, inductor):
    the cuda backend must set TRITON_INTERPRET before triton is first imported on a GPU-less machine."""
    from opport.dispatch.registry import backends

    for b in backends().values():
        b.unavailable()


# Files that take the most worker time (a run's --junitxml), first. xdist hands out whole files (--dist loadfile) in
# collection order (the Makefile turns off its reordering by test count, which sent these few-test files last): a
# long file started last keeps one worker busy while the other idles.
SLOWEST_FILES = ("test_fleet.py", "test_recipes.py", "test_integration_transformers_families.py", "test_bench.py",
                 "test_cuda_backend.py", "test_conformance_tiers.py", "test_neuron_kernels.py", "test_cuda_aot.py",
                 "test_integration_transformers_batches.py", "test_training.py", "test_one_verdict.py",
                 "test_serving_engine.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name if item.path.parent.name == "tests" else "", len(rank)))


@pytest.fixture(scope="session")
def stored_runs(tmp_path_factory):
    """Three real runs in one results store (tests/store_runs.py): conformance, conformance with rmsnorm broken, bench."""
    from tests.store_runs import make_runs

    return make_runs(tmp_path_factory.mktemp("store"))
