"""SQLite storage of conformance and bench runs: the schema, its versioned migrations, appending a run, reading
runs back (docs/store.md).

A run is stored from the dict its `--json` report is made of, so the store and `--json` never disagree. What
is not a plain column is JSON text: nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import socket
import sqlite3
import subprocess
import urllib.parse

KINDS = ("conformance", "bench")

# cases column -> key of a case in the conformance JSON (`to_json`'s "cases")
CASE_KEYS = {"op": "op", "backend": "backend", "dtype": "dtype", "direction": "direction", "case_id": "id",
             "status": "status", "kernel": "kernel", "metrics": "metrics", "worst": "worst", "message": "message",
             "repro": "repro", "duration_s": "duration_s"}
# bench_rows column -> key of a row in the bench JSON ("rows"); `verdict` and `ceilings` are derived
ROW_KEYS = {"op": "op", "backend": "backend", "dtype": "dtype", "pass": "pass", "problem": "case", "shape": "shape",
            "impl": "impl", "status": "status", "ms": "ms", "p20_ms": "p20_ms", "p80_ms": "p80_ms", "samples": "samples",
            "gbps": "GBps", "tflops": "TFLOPs", "roofline_pct": "roofline_pct", "vs": "vs", "ceilings": "ceilings"}
JSON_COLUMNS = {"metrics", "worst", "vs", "ceilings"}


class StoreError(ValueError):
    """A store that cannot be used (missing, not SQLite, not opport's, newer than this opport) or a run it lacks."""


# --------------------------------------------------------------------------- schema and migrations


def _v1(db):
    """The tables: runs, the hosts of each run, conformance cases, bench rows."""
    db.execute("""CREATE TABLE runs (
        id INTEGER PRIMARY KEY AUTOINCREMENT, created TEXT NOT NULL, kind TEXT NOT NULL, git_commit TEXT,
        opport_version TEXT NOT NULL, argv TEXT NOT NULL, exit_code INTEGER, report TEXT NOT NULL)""")
    db.execute("""CREATE TABLE hosts (
        run_id INTEGER NOT NULL REFERENCES runs(id), host TEXT NOT NULL, record TEXT NOT NULL,
        PRIMARY KEY (run_id, host))""")
    db.execute("""CREATE TABLE cases (
        run_id INTEGER NOT NULL REFERENCES runs(id), host TEXT NOT NULL, op TEXT NOT NULL, backend TEXT NOT NULL,
        dtype TEXT NOT NULL, direction TEXT, case_id TEXT NOT NULL, status TEXT NOT NULL, kernel TEXT, metrics TEXT,
        worst TEXT, message TEXT, repro TEXT, duration_s REAL, extra TEXT NOT NULL)""")
    db.execute("""CREATE TABLE bench_rows (
        run_id INTEGER NOT NULL REFERENCES runs(id), host TEXT NOT NULL, op TEXT NOT NULL, backend TEXT NOT NULL,
        dtype TEXT NOT NULL, pass TEXT NOT NULL, problem TEXT, shape TEXT, impl TEXT NOT NULL, status TEXT NOT NULL,
        verdict TEXT NOT NULL, ms REAL, p20_ms REAL, p80_ms REAL, samples INTEGER, gbps REAL, tflops REAL,
        roofline_pct REAL, vs TEXT, ceilings TEXT, extra TEXT NOT NULL)""")


def _v2(db):
    """Indexes for what history and report ask: one run's cases or rows, one op across runs."""
    db.execute("CREATE INDEX cases_run ON cases (run_id, op, backend, host)")
    db.execute("CREATE INDEX bench_rows_run ON bench_rows (run_id, op, backend, host)")


# MIGRATIONS[n] takes a store from version n to n + 1 (`PRAGMA user_version`); only ever append to it.
MIGRATIONS = (_v1, _v2)
VERSION = len(MIGRATIONS)


@contextlib.contextmanager
def _transaction(db):
    db.execute("BEGIN IMMEDIATE")  # the write lock first: two processes never migrate or append at once
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _version(db, path: str) -> int:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > VERSION:
        raise StoreError(f"{path!r}: store schema version {version} is newer than this opport's ({VERSION}): "
                         "upgrade opport to read it")
    if version == 0 and db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
        raise StoreError(f"{path!r}: an SQLite database, but not an opport results store")
    return version


def _migrate(db, path: str):
    if _version(db, path) == VERSION:
        return  # no write lock for a store that is current (history and report only read)
    with _transaction(db):
        for n in range(_version(db, path), VERSION):  # read again under the lock: another process may have done it
            MIGRATIONS[n](db)
        db.execute(f"PRAGMA user_version = {VERSION}")


# --------------------------------------------------------------------------- the store


class Store:
    """An open results store: `Store(path)` opens (and migrates) an existing one, `create=True` may make it."""

    def __init__(self, path: str, create: bool = False):
        self.path = path
        if os.path.isdir(path):
            raise StoreError(f"{path!r}: is a directory, not a results store")
        if not create and not os.path.exists(path):
            raise StoreError(f"{path!r}: no such file")
        uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode={'rwc' if create else 'rw'}"
        try:
            self.db = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=30)
        except sqlite3.Error as e:
            raise StoreError(f"{path!r}: cannot be opened: {e}") from e
        try:
            _migrate(self.db, path)
        except sqlite3.Error as e:  # not SQLite at all, corrupt, locked, read-only
            self.db.close()
            raise StoreError(f"{path!r}: cannot be read as a results store: {e}") from e
        except StoreError:
            self.db.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.db.close()

    def _guard(self, fn, *args):
        """fn(*args), with SQLite's errors (not a database, corrupt, locked, read-only) as one StoreError."""
        try:
            return fn(*args)
        except sqlite3.Error as e:
            raise StoreError(f"{self.path!r}: {e}") from e

    def _select(self, sql: str, params=()) -> list[dict]:
        def run():
            cur = self.db.execute(sql, params)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, r)) for r in cur.fetchall()]

        return self._guard(run)

    # ----------------------------------------------------------------------- writing

    def append(self, kind: str, report: dict, argv: list, exit_code: int | None) -> int:
        """Store one run from its JSON report (what `--json` writes); returns the new run id."""
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}: expected one of {KINDS}")
        report = json.loads(json.dumps(report, default=_plain))  # exactly what --json would hold
        items = report.get("cases" if kind == "conformance" else "rows", [])
        hosts, default = _hosts(report, kind)
        top = {k: v for k, v in report.items() if k not in ("cases", "rows", "hosts")}
        run = (_now(), kind, git_commit(), _opport_version(), json.dumps(list(argv)), exit_code, json.dumps(top))

        def write():
            with _transaction(self.db):
                cur = self.db.execute(
                    "INSERT INTO runs (created, kind, git_commit, opport_version, argv, exit_code, report) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)", run)
                run_id = cur.lastrowid
                self.db.executemany("INSERT INTO hosts (run_id, host, record) VALUES (?, ?, ?)",
                                    [(run_id, h, json.dumps(r)) for h, r in hosts.items()])
                for item in items:
                    host = item.get("host", default)
                    if host not in hosts:
                        raise ValueError(f"report row {item.get('id', item.get('op'))!r}: host {host!r} is not in the "
                                         "report's hosts")
                    if kind == "conformance":
                        self._insert("cases", run_id, host, _case_columns(item))
                    else:
                        self._insert("bench_rows", run_id, host, _row_columns(item, report, hosts[host]))
                return run_id

        return self._guard(write)

    def _insert(self, table: str, run_id: int, host: str, cols: dict):
        names = ["run_id", "host", *cols]
        self.db.execute(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                        (run_id, host, *cols.values()))

    # ----------------------------------------------------------------------- reading

    def runs(self, run_id: int | None = None) -> list[dict]:
        """Every run (or the one), oldest first: id, created, kind, git_commit, opport_version, argv, exit_code, hosts."""
        cols = "id, created, kind, git_commit, opport_version, argv, exit_code"
        if run_id is None:
            out = self._select(f"SELECT {cols} FROM runs ORDER BY id")
            names = self._select("SELECT run_id, host FROM hosts ORDER BY host")
        else:
            out = self._select(f"SELECT {cols} FROM runs WHERE id = ?", (run_id,))
            names = self._select("SELECT run_id, host FROM hosts WHERE run_id = ? ORDER BY host", (run_id,))
        hosts: dict = {}
        for h in names:
            hosts.setdefault(h["run_id"], []).append(h["host"])
        for r in out:
            r["argv"] = json.loads(r["argv"])
            r["hosts"] = hosts.get(r["id"], [])
        return out

    def run(self, run_id: int) -> dict:
        """One run (as `runs` gives it), or a StoreError naming the id."""
        found = self.runs(run_id)
        if found:
            return found[0]
        first, last = self._select("SELECT min(id) AS a, max(id) AS b FROM runs")[0].values()
        have = f"its runs are {first}..{last}" if first is not None else "it holds no runs"
        raise StoreError(f"run {run_id}: no such run in {self.path!r} ({have}; `opport history {self.path}` lists them)")

    def hosts(self, run_id: int) -> dict:
        """{host id: its record} of one run."""
        return {r["host"]: json.loads(r["record"])
                for r in self._select("SELECT host, record FROM hosts WHERE run_id = ? ORDER BY host", (run_id,))}

    def cases(self, run_id: int) -> list[dict]:
        """One run's conformance cases as its JSON report had them, each with its "host"."""
        return [_item(r, CASE_KEYS) for r in self._select("SELECT * FROM cases WHERE run_id = ? ORDER BY rowid", (run_id,))]

    def bench_rows(self, run_id: int) -> list[dict]:
        """One run's bench rows as its JSON report had them, each with "host", "backend", "verdict" and "ceilings"."""
        rows = self._select("SELECT * FROM bench_rows WHERE run_id = ? ORDER BY rowid", (run_id,))
        return [{**_item(r, ROW_KEYS), "verdict": r["verdict"]} for r in rows]

    def case_counts(self, run_id: int | None = None) -> list[dict]:
        """{run_id, op, backend, host, status, n} of every run (or one): what the matrix and the trend show."""
        where = "" if run_id is None else "WHERE run_id = ?"
        return self._select(f"SELECT run_id, op, backend, host, status, count(*) AS n FROM cases {where} "
                            "GROUP BY run_id, op, backend, host, status ORDER BY run_id, op, backend, host",
                            () if run_id is None else (run_id,))

    def speed_ratios(self) -> list[dict]:
        """{run_id, op, vs} of every opport bench row with same-run baseline ratios, oldest run first."""
        rows = self._select("SELECT run_id, op, vs FROM bench_rows WHERE impl = 'opport' AND vs IS NOT NULL ORDER BY run_id")
        return [{**r, "vs": json.loads(r["vs"])} for r in rows]

    def counts(self) -> dict:
        """{run id: {status: n}}: conformance cases by status, opport's bench rows by verdict."""
        out: dict = {}
        for r in self._select("SELECT run_id, status, count(*) AS n FROM cases GROUP BY run_id, status "
                              "UNION ALL SELECT run_id, verdict, count(*) FROM bench_rows WHERE impl = 'opport' "
                              "GROUP BY run_id, verdict"):
            out.setdefault(r["run_id"], {})[r["status"]] = r["n"]
        return out


# --------------------------------------------------------------------------- report -> columns


def _case_columns(case: dict) -> dict:
    cols = {col: case.get(key) for col, key in CASE_KEYS.items()}
    cols["extra"] = _extra(case, CASE_KEYS)
    return _encode(cols)


def _row_columns(row: dict, report: dict, host: dict) -> dict:
    """A bench row's columns: its backend is the report's, its ceilings its own, its host's or the report's."""
    full = {**row, "backend": row.get("backend", report.get("backend")),
            "ceilings": row.get("ceilings") or host.get("ceilings") or report.get("ceilings")}
    cols = {col: full.get(key) for col, key in ROW_KEYS.items()}
    cols["verdict"] = verdict(row)
    cols["extra"] = _extra(row, ROW_KEYS)
    return _encode(cols)


def _extra(item: dict, keys: dict) -> dict:
    """What no column holds: other keys, and keys whose value is None (a NULL column reads back as no key)."""
    return {k: v for k, v in item.items() if (k not in keys.values() or v is None) and k != "host"}


def verdict(row: dict) -> str:
    """A bench row in conformance words: pass (ran and, if checked, correct), fail (wrong result), error, skip."""
    if row.get("status") == "ok":
        return "fail" if row.get("correct") is False else "pass"
    return row.get("status") or "error"


def _encode(cols: dict) -> dict:
    return {k: json.dumps(v) if (k in JSON_COLUMNS and v is not None) or k == "extra" else v for k, v in cols.items()}


def _item(r: dict, keys: dict) -> dict:
    """A stored case or row back as its report dict (keys whose column is NULL are left out), with its host."""
    out = {"host": r["host"]}
    for col, key in keys.items():
        if r[col] is not None:
            out[key] = json.loads(r[col]) if col in JSON_COLUMNS else r[col]
    return {**out, **json.loads(r["extra"])}


# --------------------------------------------------------------------------- what a run records about where it ran


def _hosts(report: dict, kind: str) -> tuple[dict, str | None]:
    """({host id: record}, the host of rows that name none): the report's own hosts, else this machine."""
    if report.get("hosts"):
        hosts = report["hosts"]
        return hosts, next(iter(hosts)) if len(hosts) == 1 else None
    me = local_host(report, kind)
    return {me["hostname"]: me}, me["hostname"]


def local_host(report: dict, kind: str) -> dict:
    """This machine: name, platform, Python, and the mode of each backend the run used (as doctor reports it)."""
    if kind == "conformance":
        modes = {n: i.get("mode") or f"unavailable: {i.get('unavailable')}" for n, i in report.get("backends", {}).items()}
    else:
        modes = {report.get("backend"): report.get("mode")}
    rec = {"hostname": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
           "python": platform.python_version(), "backends": modes}
    if report.get("device"):
        rec["device"] = report["device"]
    return rec


def git_commit() -> str | None:
    """The commit checked out in the current directory, or None outside a git checkout (or without git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def _opport_version() -> str:
    from opport._version import __version__

    return __version__


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _plain(x):
    """What the --json writers do with values JSON lacks: NumPy scalars become numbers, sets and tuples lists."""
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def problem(flag: str, path: str | None) -> str | None:
    """Before a run: None if `path` is a usable store (an old one is migrated now) or can be created there."""
    from opport import runargs

    if path is None:
        return None
    if os.path.isfile(path) and os.path.getsize(path):
        try:
            with Store(path):
                pass
        except StoreError as e:
            return f"{flag} {e}"
        return None
    return runargs.writable(flag, path)
