"""`--cluster`: conformance and bench on a Ray cluster of several nodes on this machine (docs/fleet.md).

One module-scoped cluster (ray.cluster_utils): a head node, a node with a fake GPU and one with fake
`neuron_cores`, one CPU each. The node-kill test runs last: it removes the neuron node mid-run.
"""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import ray  # opport[fleet]: the Makefile's venv has it, so CI runs these

from opport.conformance import Options, run
from opport.conformance import report as rep
from opport.conformance.runner import Report
from opport.fleet import cluster as fleet_cluster

SOME = ("len-*", "row-1", "scalar")  # a handful of fixed cases of each op (forward and backward)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    saved = dict(os.environ)
    fleet_cluster._loopback_only()  # the nodes bind 127.0.0.1, as --cluster local does
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    gpu = c.add_node(num_cpus=1, num_gpus=1)
    trn = c.add_node(num_cpus=1, resources={"neuron_cores": 2})
    ray.init(address=c.address, log_to_driver=False, logging_level="WARNING")
    try:
        yield {"cluster": c, "gpu": gpu.node_id, "trn": trn, "head": c.head_node.node_id}
    finally:
        ray.shutdown()
        c.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def fleet_run(options, display=None):
    from opport.fleet.conformance import Executor

    return run(options, display, Executor(ray, options))


def ids(report) -> dict:
    return {c["id"]: c["status"] for c in report.cases}


def node_of(report, case) -> str:
    return report.hosts[case["host"]]["node_id"]


def test_same_cases_as_the_local_run_and_every_row_names_its_host(cluster):
    o = Options(backends=("cpu",), ops=("silu",), examples=3, layouts=False, workers=1)
    local, remote = run(o), fleet_run(o)
    assert ids(remote) == ids(local) and remote.summary == local.summary and remote.exit_code == 0
    for c in remote.cases:
        assert c["host"] in remote.hosts, c
    ran = [c for c in remote.cases if c["source"] != "plan"]
    assert {node_of(remote, c) for c in ran} <= {cluster["head"], cluster["gpu"], cluster["trn"].node_id}
    rec = next(iter(remote.hosts.values()))
    assert {"hostname", "accelerator", "backends", "python"} <= set(rec) and rec["backends"]["cpu"]["mode"] == "numpy"
    data = rep.to_json(remote)
    assert set(data["hosts"]) == set(remote.hosts) and all("host" in c for c in data["cases"])


def test_cases_are_placed_by_the_backends_device_resource(cluster):
    o = Options(backends=("cpu", "cuda", "neuron"), ops=("silu",), dtypes=("float32",), cases=SOME, errors=False,
                layouts=False)
    report = fleet_run(o)
    assert report.exit_code == 0, [c["message"] for c in report.failures()]
    where = {(c["backend"], node_of(report, c)) for c in report.cases if c["source"] != "plan"}
    assert {n for b, n in where if b == "cuda"} == {cluster["gpu"]}  # needs "GPU": only the fake GPU node has one
    assert {n for b, n in where if b == "neuron"} == {cluster["trn"].node_id}  # needs "neuron_cores"
    assert {b for b, _ in where} == {"cpu", "cuda", "neuron"}


def test_a_task_that_dies_is_a_crash_for_its_case_and_the_run_goes_on(cluster):
    from opport.conformance import faults

    o = Options(backends=("faulty",), ops=("rmsnorm",), dtypes=("float32",), cases=tuple(faults.EXPECTED), timeout=3.0,
                compile_timeout=0.0, setup=("opport.conformance.faults:install",), errors=False, layouts=False)
    try:
        report = fleet_run(o)
    finally:
        faults.uninstall()
    assert {c["case"]: c["status"] for c in report.cases} == faults.EXPECTED
    crashed = {c["case"]: c["message"] for c in report.cases if c["status"] == "crash"}
    assert "WorkerCrashedError" in crashed["row-129"]  # the segfault: the worker died under that case
    assert report.exit_code == 1


def test_the_conformance_command_on_a_cluster_writes_hosts_and_rows(cluster, tmp_path):
    from opport.cli import main

    out = tmp_path / "r.json"
    argv = ["conformance", "--op", "silu", "--dtype", "float32", "--case", "row-1", "-q", "--json", str(out)]
    assert main([*argv, "--cluster", cluster["cluster"].address]) == 0
    data = json.loads(out.read_text())
    assert data["cases"] and all(c["host"] in data["hosts"] for c in data["cases"]) and data["interrupted"] is False


def test_ctrl_c_cancels_the_tasks_and_keeps_a_partial_report(cluster):
    class InterruptAfterFirstResult:
        pressed = False

        def start(self, plan): pass
        def add_total(self, n): pass
        def batch_done(self, batch): pass
        def stop(self): pass

        def result(self, res):
            if res["source"] != "plan" and not self.pressed:
                self.pressed = True
                raise KeyboardInterrupt

    report = fleet_run(Options(backends=("cpu",), ops=("silu", "gelu"), examples=2, layouts=False),
                       InterruptAfterFirstResult())
    assert report.interrupted and report.exit_code == 130
    lost = [c for c in report.cases if c["status"] == "lost"]
    assert lost and all("interrupted" in c["message"] for c in lost)
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.2)  # cancelled tasks give their CPUs back
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]


def test_the_matrix_has_a_column_per_host_kind():
    def case(host, status):
        return {"id": f"silu/cuda/float32/{host}", "op": "silu", "backend": "cuda", "dtype": "float32", "status": status,
                "source": "fixed", "host": host, "kernel": "", "message": "", "repro": ""}

    r = Report(Options(backends=("cuda",)), {"cuda": {"mode": "compiled", "versions": {}, "unavailable": None}})
    r.hosts = {"a": {"accelerator": "NVIDIA H100"}, "b": {"accelerator": "NVIDIA H200"}, "c": {"accelerator": "NVIDIA H200"}}
    r.cases = [case("a", "pass"), case("b", "pass"), case("c", "fail")]
    assert rep.columns(r) == [("cuda", "NVIDIA H100"), ("cuda", "NVIDIA H200")]
    grid = rep.cells(r)
    assert grid[("silu", "cuda", "NVIDIA H100")]["float32"] == {"pass": 1}
    assert grid[("silu", "cuda", "NVIDIA H200")]["float32"] == {"pass": 1, "fail": 1}
    assert "| op | cuda (NVIDIA H100) | cuda (NVIDIA H200) |" in rep.to_markdown(r)


def test_bench_rows_are_per_host_with_that_hosts_own_ceilings(cluster, tmp_path):
    from opport.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--backend", "cpu", "--smoke", "--op", "silu", "--op", "gelu", "--op", "swiglu", "--pass", "fwd",
                 "--cluster", cluster["cluster"].address, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["hosts"]) == 3 and not data["hosts_left_out"]  # cpu runs anywhere: an actor on every node
    assert {r["op"] for r in data["rows"]} == {"silu", "gelu", "swiglu"}  # one host kind: each problem runs once
    assert len({r["host"] for r in data["rows"]}) > 1  # ... on whichever of its hosts is free
    for r in (r for r in data["rows"] if "ms" in r):
        c = data["hosts"][r["host"]]["ceilings"]
        floor = max(r["bytes"] / (c["copy_GBps"] * 1e6), r["flops"] / (c["matmul_TFLOPs"] * 1e9))
        assert r["roofline_pct"] == pytest.approx(100 * floor / r["ms"], rel=1e-3)  # judged by its own host's roofs


def test_bench_hosts_judge_themselves_and_say_why_they_cannot(cluster, tmp_path, capsys):
    """The driver plans from what cuda declares; the fake-GPU host has no real GPU, so it is left out, saying why."""
    from opport.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--backend", "cuda", "--smoke", "--op", "silu", "--cluster", cluster["cluster"].address,
                 "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    (host, why), = data["hosts_left_out"].items()
    assert not data["rows"] and host.endswith(cluster["gpu"][:6]) and "interpreter" in why, data["hosts_left_out"]


def test_missing_ray_is_one_line_and_exit_2(tmp_path):
    script = textwrap.dedent("""
        import sys
        sys.modules["ray"] = None  # as if opport[fleet] were not installed
        from opport.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    for argv in (["conformance", "--op", "silu", "--cluster", "local"], ["bench", "--op", "silu", "--cluster", "local"]):
        p = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        assert p.returncode == 2, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "pip install 'opport[fleet]'" in p.stderr, p.stderr


def test_an_address_where_nothing_answers_is_one_line_and_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    for argv in (["conformance", "--op", "silu", "--cluster", "127.0.0.1:1"],
                 ["bench", "--op", "silu", "--cluster", "ray://127.0.0.1:1"]):
        p = subprocess.run([sys.executable, "-m", "opport", *argv], capture_output=True, text=True, cwd=tmp_path,
                           timeout=60, env=dict(env, PYTHONPATH=os.pathsep.join(sys.path)))
        assert p.returncode == 2 and "nothing answers at 127.0.0.1:1" in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_cluster_local_listens_on_loopback_only_and_has_no_dashboard(tmp_path):
    script = textwrap.dedent("""
        import json
        import ray, psutil  # ray puts its bundled psutil on the path
        from opport.fleet.cluster import connect
        with connect("local", num_cpus=1) as ray:
            procs = psutil.Process().children(recursive=True) + [psutil.Process()]
            listening = [(c.laddr.ip, c.laddr.port, " ".join(p.cmdline())[:300]) for p in procs
                         for c in p.net_connections("inet") if c.status == "LISTEN"]
            print(json.dumps({"listening": listening, "nodes": [n["NodeManagerAddress"] for n in ray.nodes()]}))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env=dict(env, PYTHONPATH=os.pathsep.join(sys.path)))
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["nodes"] == ["127.0.0.1"]
    assert any("gcs_server" in cmd for _, _, cmd in got["listening"])  # the check sees Ray's servers at all
    assert {ip for ip, _, _ in got["listening"]} <= {"127.0.0.1", "::ffff:127.0.0.1"}, got["listening"]
    # Ray keeps a headless dashboard process (usage-stats module, --disable-frontend): it must serve nothing
    assert not [x for x in got["listening"] if "dashboard" in x[2] or x[1] == 8265], got["listening"]


def test_a_node_killed_mid_run_leaves_every_case_accounted_for(cluster):
    """Runs last (it removes the neuron node): cpu cases on it move to the other nodes; neuron cases, which no
    other node can take, are `lost` with the reason; the exit status says so."""
    trn = cluster["trn"]
    killed = threading.Event()

    class KillOnFirstNeuronResult:
        def start(self, plan): pass
        def add_total(self, n): pass
        def batch_done(self, batch): pass
        def stop(self): pass

        def result(self, res):
            if res["backend"] == "neuron" and res["source"] != "plan" and not killed.is_set():
                killed.set()
                cluster["cluster"].remove_node(trn, allow_graceful=False)

    o = Options(backends=("cpu", "neuron"), ops=("silu",), dtypes=("float32", "bfloat16"), examples=2, layouts=False)
    planned = {c["id"] for c in run(Options(**{**o.__dict__, "backends": ("cpu",), "workers": 1})).cases}
    report = fleet_run(o, KillOnFirstNeuronResult())
    assert killed.is_set()
    got = ids(report)
    assert planned <= set(got) and all(got[i] == "pass" for i in planned)  # cpu: every case, moved or not, passed
    neuron = {i: s for i, s in got.items() if i.split("/")[1] == "neuron"}
    lost = [c for c in report.cases if c["status"] == "lost"]
    assert lost and set(neuron.values()) <= {"pass", "lost"}
    assert all("no alive node offers {'neuron_cores': 1}" in c["message"] for c in lost), lost[0]["message"]
    assert report.exit_code == 1 and report.summary["lost"] == len(lost)


