"""Conformance and bench across a Ray cluster: `--cluster local|auto|ray://host:port` (docs/fleet.md).

cluster.py connects (or starts Ray on this machine, loopback only); host.py names the hosts and holds
their doctor records; conformance.py runs conformance batches as Ray tasks placed by each backend's
declared device resource; bench.py runs benchmark problems on one actor per host, each with the ceilings
it measured itself. Ray is an optional dependency (`opport[fleet]`), imported only here and only when asked.
"""

from __future__ import annotations

INSTALL = "pip install 'opport[fleet]'"


class FleetError(ValueError):
    """A cluster that cannot be used as asked (ray missing, an address that does not answer): a user's
    problem, so the command prints one line and exits 2."""


def add_arguments(p):
    """--cluster and --dashboard, on `opport conformance` and `opport bench` (without them nothing changes)."""
    p.add_argument("--cluster", metavar="ADDRESS", default=None,
                   help="run on a Ray cluster: local (start Ray here, listening on 127.0.0.1 only), auto (join the "
                        "cluster in RAY_ADDRESS or the one this machine runs), ray://HOST:PORT (needs opport[fleet])")
    p.add_argument("--dashboard", action="store_true", help="with --cluster local: start Ray's dashboard (on 127.0.0.1)")


def require_ray():
    """The `ray` module, or FleetError saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise FleetError(f"--cluster needs Ray, which is not installed here ({e}): {INSTALL}") from e
    return ray
