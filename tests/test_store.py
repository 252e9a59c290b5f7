"""The results store (docs/store.md): `--store DB` on conformance and bench, its schema and migrations, and
`opport history` (the listing and --compare), on real runs (the `stored_runs` fixture, tests/store_runs.py)."""

from __future__ import annotations

import copy
import json
import re
import socket
import sqlite3
import subprocess
from pathlib import Path

import pytest

import opport
from opport.cli import main
from opport.store import db
from tests.store_runs import CONF

ROOT = Path(__file__).resolve().parents[1]


def _without(items: list, *keys) -> list:
    return [{k: v for k, v in it.items() if k not in keys} for it in items]


# --------------------------------------------------------------------------- what a run stores


def test_cases_and_rows_are_stored_as_the_json_report_has_them(stored_runs):
    with db.Store(stored_runs["db"]) as store:
        assert store.cases(1) == stored_runs["json"][1]["cases"]  # each case names its host, as in --json
        assert store.cases(2) == stored_runs["json"][2]["cases"]
        rows, report = store.bench_rows(3), stored_runs["json"][3]
    assert _without(rows, "backend", "ceilings", "verdict") == report["rows"]
    assert {r["backend"] for r in rows} == {"cpu"} and all(r["ceilings"] == report["ceilings"] for r in rows)
    assert [r["verdict"] for r in rows] == [db.verdict(r) for r in report["rows"]]


def test_each_run_records_when_what_and_where(stored_runs):
    with db.Store(stored_runs["db"]) as store:
        runs, hosts = store.runs(), store.hosts(1)
        raw = store.db.execute("SELECT exit_code, report FROM runs WHERE id = 2").fetchone()
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)  # here, as the runs did
    head = git.stdout.strip() if git.returncode == 0 else None
    assert [r["kind"] for r in runs] == ["conformance", "conformance", "bench"]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", r["created"]) for r in runs)
    assert all(r["git_commit"] == head and r["opport_version"] == opport.__version__ for r in runs)
    assert runs[0]["argv"] == ["opport", *CONF, "--json", runs[0]["argv"][-3], "--store", stored_runs["db"]]
    assert raw[0] == stored_runs["status"][2] == 1  # the broken kernel's run failed
    assert json.loads(raw[1])["summary"] == stored_runs["json"][2]["summary"]
    me = socket.gethostname()
    assert list(hosts) == [me] and hosts[me]["backends"]["cpu"]["mode"] == "numpy" and hosts[me]["python"]
    assert all(r["hosts"] == [me] for r in runs)


def test_no_commit_outside_a_git_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert db.git_commit() is None


def test_a_report_with_its_own_hosts_is_stored_per_host(stored_runs, tmp_path):
    """The shape a fleet run writes: top-level "hosts" and a "host" on every row."""
    report = copy.deepcopy(stored_runs["json"][1])
    report["hosts"] = {"gpu-a": {"accelerator": "H200"}, "trn-b": {"accelerator": "trn1"}}
    for i, c in enumerate(report["cases"]):
        c["host"] = "gpu-a" if i % 2 else "trn-b"
    with db.Store(str(tmp_path / "r.db"), create=True) as store:
        run_id = store.append("conformance", report, ["opport", "conformance"], 0)
        assert store.hosts(run_id) == report["hosts"]
        assert [c["host"] for c in store.cases(run_id)] == [c["host"] for c in report["cases"]]
        report["cases"][0]["host"] = "elsewhere"
        with pytest.raises(ValueError, match="elsewhere"):
            store.append("conformance", report, ["opport", "conformance"], 0)
        assert [r["id"] for r in store.runs()] == [run_id]  # the refused run left nothing behind


def test_a_report_without_hosts_is_stored_as_this_machine(stored_runs, tmp_path):
    """A JSON report from before reports named their hosts: one host, this machine, for every case."""
    report = copy.deepcopy(stored_runs["json"][1])
    del report["hosts"]
    for c in report["cases"]:
        del c["host"]
    with db.Store(str(tmp_path / "r.db"), create=True) as store:
        run_id = store.append("conformance", report, ["opport", "conformance"], 0)
        me = socket.gethostname()
        assert list(store.hosts(run_id)) == [me] and store.hosts(run_id)[me]["backends"] == {"cpu": "numpy"}
        assert {c["host"] for c in store.cases(run_id)} == {me}


def test_values_are_json_text_never_pickles(stored_runs):
    con = sqlite3.connect(stored_runs["db"])
    for table, cols in (("cases", ("metrics", "worst", "extra")), ("bench_rows", ("vs", "ceilings", "extra")),
                        ("runs", ("argv", "report")), ("hosts", ("record",))):
        for col in cols:
            for (v,) in con.execute(f"SELECT {col} FROM {table} WHERE {col} IS NOT NULL"):
                assert isinstance(v, str), (table, col)
                json.loads(v)
    con.close()


# --------------------------------------------------------------------------- schema and migrations


def _v1_store(path: Path):
    """A store as the first version of this code wrote it: schema v1 and one conformance run."""
    con = sqlite3.connect(path)
    db.MIGRATIONS[0](con)
    con.execute("PRAGMA user_version = 1")
    con.execute("INSERT INTO runs (created, kind, git_commit, opport_version, argv, exit_code, report) VALUES "
                "('2026-12-01T00:00:00+00:00', 'conformance', NULL, '0.1.0', '[\"opport\"]', 0, '{}')")
    con.execute("INSERT INTO hosts VALUES (1, 'old-host', '{}')")
    con.execute("INSERT INTO cases (run_id, host, op, backend, dtype, direction, case_id, status, extra) VALUES "
                "(1, 'old-host', 'softmax', 'cpu', 'float32', 'forward', 'softmax/cpu/float32/tiny', 'pass', '{}')")
    con.commit()
    con.close()


def test_a_v1_store_is_migrated_and_read_by_the_current_code(tmp_path, capsys):
    path = tmp_path / "v1.db"
    _v1_store(path)
    assert main(["history", str(path)]) == 0
    assert re.search(r"\n\s+1\s+2026-12-01T00:00:00\+00:00\s+conformance\s+-\s+1\s+0\s+0\s+old-host", capsys.readouterr().out)
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA user_version").fetchone()[0] == db.VERSION > 1
    assert {"cases_run", "bench_rows_run"} <= {n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    con.close()
    with db.Store(str(path)) as store:
        assert store.cases(1)[0]["id"] == "softmax/cpu/float32/tiny"


def test_docs_describe_every_column_of_the_schema(tmp_path):
    with db.Store(str(tmp_path / "new.db"), create=True) as store:
        tables = [t for (t,) in store.db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite%'")]
        doc = (ROOT / "docs" / "store.md").read_text()
        for t in tables:
            assert f"`{t}`" in doc, t
            for col in [r[1] for r in store.db.execute(f"PRAGMA table_info({t})")]:
                assert re.search(rf"\| `{col}` \|", doc), f"docs/store.md does not describe {t}.{col}"


@pytest.mark.parametrize("make, why", [
    (lambda p: p.write_text("not a database"), "cannot be read as a results store"),
    (lambda p: sqlite3.connect(p).execute("CREATE TABLE t (x)").connection.commit(), "not an opport results store"),
    (lambda p: sqlite3.connect(p).execute("PRAGMA user_version = 99").connection.commit(), "newer than this opport"),
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: None, "no such file"),
])
def test_a_store_that_cannot_be_used_is_one_line(tmp_path, capsys, make, why):
    path = tmp_path / "x.db"
    make(path)
    assert main(["history", str(path)]) == 2
    err = capsys.readouterr().err
    assert why in err and str(path) in err and err.count("\n") == 1


@pytest.mark.parametrize("cmd", [["conformance", *CONF[1:]], ["bench", "--backend", "cpu", "--smoke"]])
def test_a_bad_store_is_refused_before_the_run(tmp_path, capsys, monkeypatch, cmd):
    import opport.bench.cli
    import opport.conformance.runner

    def tripped(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(opport.conformance.runner, "run", tripped)
    monkeypatch.setattr(opport.bench.cli, "setup_run", tripped)
    bad = tmp_path / "bad.db"
    bad.write_text("not a database")
    assert main([*cmd, "--store", str(bad)]) == 2
    assert "--store" in capsys.readouterr().err
    assert main([*cmd, "--store", str(tmp_path / "missing" / "r.db")]) == 2
    assert "--store" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", [["bench", "--overhead"], ["conformance", "--self-test"]])
def test_commands_with_no_run_to_keep_refuse_a_store(tmp_path, capsys, cmd):
    assert main([*cmd, "--store", str(tmp_path / "r.db")]) == 2
    assert cmd[1] in capsys.readouterr().err and not (tmp_path / "r.db").exists()


# --------------------------------------------------------------------------- history


def test_history_lists_every_run_with_its_counts(stored_runs, capsys):
    assert main(["history", stored_runs["db"]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["id", "created", "(UTC)", "kind", "commit", "pass", "fail", "skipped", "hosts"]
    for run_id in (1, 2):
        s = stored_runs["json"][run_id]["summary"]
        failed = sum(s[k] for k in ("fail", "error", "crash", "timeout", "xpass"))
        cells = lines[run_id].split()
        assert cells[0] == str(run_id) and cells[2] == "conformance"
        assert cells[4:7] == [str(s["pass"]), str(failed), str(s["skip"] + s["xfail"])] and cells[7] == socket.gethostname()
    assert failed > 0  # run 2 broke rmsnorm
    mine = [r for r in stored_runs["json"][3]["rows"] if r["impl"] == "opport"]
    assert lines[3].split()[2] == "bench" and lines[3].split()[4] == str(len(mine))


def test_compare_shows_cases_that_started_failing_and_passing(stored_runs, capsys):
    before, after = ({c["id"]: c for c in stored_runs["json"][n]["cases"]} for n in (1, 2))
    flipped = sorted(i for i in after if after[i]["status"] == "fail" and before[i]["status"] == "pass")
    assert flipped and all(i.startswith("rmsnorm/cpu/float32/") for i in flipped)  # the forward only

    assert main(["history", stored_runs["db"], "--compare", "1", "2"]) == 1  # something started failing
    out = capsys.readouterr().out
    assert f"started failing: {len(flipped)}\n" in out and "started passing: 0\n" in out
    listed = re.findall(r"^  pass -> fail  (\S+) on ", out, re.M)
    assert sorted(listed) == flipped
    assert all(f"repro: {after[i]['repro']}" in out for i in flipped)

    assert main(["history", stored_runs["db"], "--compare", "2", "1"]) == 0
    out = capsys.readouterr().out
    assert f"started passing: {len(flipped)}\n" in out and "started failing: 0\n" in out


def test_compare_bench_rows_beyond_their_noise(stored_runs, tmp_path, capsys):
    """A row 10x slower with its spread is reported; one 1% slower inside its p20-p80 spread is not; one that
    errors now is reported as failed."""
    report = copy.deepcopy(stored_runs["json"][3])
    mine = [r for r in report["rows"] if r["impl"] == "opport" and r.get("ms")]
    slow, steady, broken = mine[0], mine[1], mine[2]
    for k in ("ms", "p20_ms", "p80_ms", "vs"):
        del broken[k]
    broken.update(status="error", error="RuntimeError: boom")
    top = slow["p80_ms"]  # slower by 10x its own spread's top: beyond noise however loaded the machine was
    slow["p20_ms"], slow["ms"], slow["p80_ms"] = 10 * top, 11 * top, 12 * top
    steady["ms"] *= 1.01
    steady["p20_ms"], steady["p80_ms"] = steady["p20_ms"] * 0.98, steady["p80_ms"] * 1.02
    path = tmp_path / "r.db"
    with db.Store(str(path), create=True) as store:
        store.append("bench", stored_runs["json"][3], ["opport", "bench"], 0)
        store.append("bench", report, ["opport", "bench"], 0)
    name = f"{slow['op']} {slow['shape']} {slow['dtype']} {slow['pass']} (cpu) on "
    assert main(["history", str(path), "--compare", "1", "2"]) == 1
    out = capsys.readouterr().out
    assert "slower beyond noise: 1\n" in out and f"  {name}" in out and "faster beyond noise: 0\n" in out
    assert f"timed in run A, failed in run B: 1\n  {broken['op']} {broken['shape']} {broken['dtype']} {broken['pass']} " \
           "(cpu) on " in out and out.rstrip().endswith("error RuntimeError: boom")
    assert main(["history", str(path), "--compare", "2", "1"]) == 0
    out = capsys.readouterr().out
    assert "faster beyond noise: 1\n" in out and f"  {name}" in out and "slower beyond noise: 0\n" in out
    assert "failed in run B: 0\n" in out


def test_compare_needs_two_runs_of_one_kind(stored_runs, capsys):
    assert main(["history", stored_runs["db"], "--compare", "1", "3"]) == 2
    assert "run 1 is conformance, run 3 is bench" in capsys.readouterr().err
    assert main(["history", stored_runs["db"], "--compare", "1", "42"]) == 2
    assert "run 42: no such run" in capsys.readouterr().err
    assert main(["history", stored_runs["db"], "--compare", "1", "x"]) == 2
    assert "invalid int value" in capsys.readouterr().err


def test_an_empty_store_lists_and_draws_nothing(tmp_path, capsys):
    path = str(tmp_path / "empty.db")
    db.Store(path, create=True).db.close()
    assert main(["history", path]) == 0
    assert capsys.readouterr().out == f"{path}: no runs stored yet\n"
    assert main(["report", path, "--html", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "index.html").read_text()
    assert "No conformance run stored." in page and "No bench run stored." in page and "<svg" not in page


def test_the_documented_commands_parse():
    """Every `opport` line in docs/store.md's and the README's code blocks is a command the CLI accepts."""
    import shlex

    from opport.cli import build_parser

    lines = [ln.split("#")[0].strip() for doc in ("docs/store.md", "README.md")
             for block in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S) for ln in block.splitlines()]
    store_lines = [ln for ln in lines if ln.startswith("opport ") and re.search(r"--store|history|report", ln)]
    assert len(store_lines) >= 10
    for ln in store_lines:
        build_parser().parse_args(shlex.split(ln)[1:])  # a flag the CLI lacks raises UsageError
