"""Hosts of a cluster run: what each one is (its doctor record, computed once per worker process there) and
the id the report names it by."""

from __future__ import annotations

_record: dict | None = None  # this process's doctor record (one host: it does not change during a run)
_setups: set = set()  # --setup hook lists already run in this process


def here(setup: tuple = ()) -> tuple:
    """(node id, doctor record) of the host running this task; runs the --setup hooks first (they may
    register backends the record must show), once per process."""
    global _record
    import ray

    from opport.conformance.worker import run_setup
    from opport.doctor import host_record

    if setup not in _setups:
        run_setup(setup)
        _setups.add(setup)
        _record = None
    if _record is None:
        _record = host_record()
    return ray.get_runtime_context().get_node_id(), _record


class HostBook:
    """Host ids by Ray node id: the hostname, or hostname:<node id prefix> where several nodes share a hostname
    (nodes started on one machine); `records` holds each host's doctor record."""

    def __init__(self, nodes: list):
        """`nodes`: cluster.alive_nodes() at the start of the run."""
        names = [name for _, name, _ in nodes]
        self.ids = {node: f"{name}:{node[:6]}" if names.count(name) > 1 else name for node, name, _ in nodes}
        self.records: dict = {}  # host id -> doctor record

    def add(self, node: str, record: dict) -> str:
        """The host id of `node` (named on first sight if it joined during the run), keeping its record."""
        if node not in self.ids:
            name = record["hostname"]
            self.ids[node] = f"{name}:{node[:6]}" if name in self.ids.values() else name
        host = self.ids[node]
        self.records.setdefault(host, dict(record, node_id=node))
        return host
