"""Join a Ray cluster, or start a one-node one on this machine that listens on 127.0.0.1 only."""

from __future__ import annotations

import contextlib
import os
import sys

from opport.fleet import FleetError, require_ray

LOOPBACK = "127.0.0.1"
# Read by Ray when it is imported: with clusters "disabled" Ray takes 127.0.0.1 as the node address, and its
# GCS, raylet and workers then bind there instead of on every interface.
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_NO_TELEMETRY_ENV = "RAY_USAGE_STATS_ENABLED"  # Ray's usage reports: nothing leaves the machine
CONNECT_TIMEOUT_S = 10.0  # a cluster's head answers a TCP connect well within this


@contextlib.contextmanager
def connect(address: str, dashboard: bool = False, num_cpus: int | None = None):
    """Yields the `ray` module, connected. "local" starts Ray here (and stops it after); "auto" (or
    RAY_ADDRESS) and "ray://host:port" or "host:port" join a running cluster. A process already connected
    (a test's cluster, a notebook) is used as it is and left up."""
    if address == "local":
        _loopback_only()
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    _check_reachable(address)
    try:
        if address == "local":
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=dashboard, dashboard_host=LOOPBACK,
                     log_to_driver=False, logging_level="WARNING")
        else:
            ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    except Exception as e:  # Ray raises ConnectionError, ValueError, RuntimeError, TimeoutError for a bad address
        raise FleetError(f"--cluster {address}: cannot connect: {type(e).__name__}: {_first_line(e)}") from e
    try:
        if address == "local":
            _check_loopback(ray)
        yield ray
    finally:
        ray.shutdown()


def _check_reachable(address: str):
    """FleetError at once when nothing listens at the address (Ray itself retries its GCS for minutes)."""
    import socket

    target = os.environ.get("RAY_ADDRESS", "") if address == "auto" else address
    host, colon, port = target.removeprefix("ray://").rpartition(":")
    if address == "local" or not colon or not port.isdigit():
        return  # "local", or "auto" without RAY_ADDRESS: Ray finds the cluster on this machine, or says there is none
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise FleetError(f"--cluster {address}: nothing answers at {host}:{port} ({e})") from e


def _loopback_only():
    """Make the Ray started by this process (and its child processes) use 127.0.0.1 and send no usage stats."""
    os.environ[_LOOPBACK_ENV] = "0"
    os.environ[_NO_TELEMETRY_ENV] = "0"
    # the workers Ray starts import opport: give them this process's import path, absolute (as the local pool does)
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray imported earlier in this process: its constant was read already
        constants.ENABLE_RAY_CLUSTER = False


def _check_loopback(ray):
    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    if addresses != {LOOPBACK}:
        raise FleetError(f"--cluster local: Ray bound to {sorted(addresses)}, not {LOOPBACK} only; refusing to run")


def alive_nodes(ray) -> list:
    """[(node id, hostname, resources)] of the nodes alive now."""
    return [(n["NodeID"], n["NodeManagerHostname"], n["Resources"]) for n in ray.nodes() if n["Alive"]]


def offered(ray, need: dict) -> bool:
    """Whether some alive node has every resource in `need` (in total, busy or not)."""
    return any(all(res.get(k, 0) >= v for k, v in need.items()) for _, _, res in alive_nodes(ray))


def task_options(need: dict) -> dict:
    """Ray's options for a task needing `need` (one CPU besides): Ray takes GPUs as num_gpus, not a resource."""
    rest = {k: v for k, v in need.items() if k != "GPU"}
    return {"num_cpus": 1, "num_gpus": need.get("GPU", 0), **({"resources": rest} if rest else {})}


def requirement(backend_name: str, ray) -> dict:
    """What a case or problem of this backend needs: its device resource where the cluster offers it (compiled
    cuda on GPU nodes, neuron hardware on neuron_cores nodes), else nothing (cpu, emulated: any node)."""
    from opport.dispatch import get_backend

    res = get_backend(backend_name).capabilities.device_resource
    return {res: 1} if res and offered(ray, {res: 1}) else {}


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0]
