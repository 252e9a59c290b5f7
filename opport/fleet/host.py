"""Hosts of a cluster run: what each one is (its doctor record, computed once per worker process there) and
the id the report names it by."""

from __future__ import annotations

_records: dict = {}  # backend -> this process's doctor record for it (a host does not change during a run)
_setups: set = set()  # --setup hook lists already run in this process


def here(backend: str, setup: tuple = ()) -> tuple:
    """(node id, doctor record naming `backend`) of the host running this task; runs the --setup hooks first
    (they may register the backend), once per process."""
    import ray

    from opport.conformance.worker import run_setup
    from opport.doctor import host_record

    if setup not in _setups:
        run_setup(setup)
        _setups.add(setup)
        _records.pop(backend, None)
    if backend not in _records:
        _records[backend] = host_record([backend])
    return ray.get_runtime_context().get_node_id(), _records[backend]


class HostBook:
    """Host ids by Ray node id: the hostname, or hostname:<node id prefix> where several nodes share a hostname
    (nodes started on one machine); `records` holds each host's doctor record."""

    def __init__(self, nodes: list):
        """`nodes`: cluster.alive_nodes() at the start of the run."""
        names = [name for _, name, _ in nodes]
        self.ids = {node: f"{name}:{node[:6]}" if names.count(name) > 1 else name for node, name, _ in nodes}
        self.records: dict = {}  # host id -> doctor record

    def add(self, node: str, record: dict) -> str:
        """The host id of `node` (named on first sight if it joined during the run); its record gains the
        backends `record` names."""
        from opport.doctor import merged

        if node not in self.ids:
            name = record["hostname"]
            self.ids[node] = f"{name}:{node[:6]}" if name in self.ids.values() else name
        host = self.ids[node]
        old = self.records.get(host)
        self.records[host] = dict(merged(old, record) if old else record, node_id=node)
        return host
