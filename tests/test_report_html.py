"""`opport report DB --html OUT/` (docs/store.md 5), opened in a real headless browser: Debian's Chromium.

The browser is required, never skipped: .ci/run installs it where it is missing. Each page is loaded with
every host name resolving nowhere, so a resource fetched from the network would be a console error too.
"""

from __future__ import annotations

import copy
import re
import shutil
import sqlite3
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from opport.cli import main
from opport.conformance.gate import STATUSES
from opport.store import db


def chromium(page: Path, tmp_path: Path, fragment: str = "") -> tuple[str, list[str]]:
    """(the DOM after the page's scripts ran, the browser console's lines) for a local file."""
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("Debian's chromium is needed for the HTML report's test: apt-get install -y chromium")
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'chromium-profile'}",
           "--host-resolver-rules=MAP * ~NOTFOUND", "--enable-logging=stderr", "--v=0", "--dump-dom",
           page.resolve().as_uri() + fragment]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]


class Dom(HTMLParser):
    """The matrix cells ({(op, backend, host): (text, panel id)}), the cases panels ({id: (hidden, text)}) and the
    number of script elements of a page."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.cells, self.panels, self.scripts, self.title = {}, {}, 0, ""
        self._cell = self._panel = None
        self._in_title = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.scripts += tag == "script"
        self._in_title = tag == "title"
        if tag == "td" and "data-op" in a:
            self._cell = (a["data-op"], a["data-backend"], a["data-host"])
            self.cells[self._cell] = ["", None]
        elif tag == "a" and self._cell:
            self.cells[self._cell][1] = a["href"].lstrip("#")
        elif tag == "section" and "cases" in a.get("class", ""):
            self._panel = a["id"]
            self.panels[self._panel] = ["hidden" in a, ""]

    def handle_endtag(self, tag):
        self._in_title = False
        if tag == "td":
            self._cell = None
        elif tag == "section":
            self._panel = None

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        if self._cell:
            self.cells[self._cell][0] += data
        if self._panel:
            self.panels[self._panel][1] += data + "\n"


def stored_counts(path: str) -> dict:
    """{(op, backend, host): 'pass 20 fail 3'} of the latest conformance run, straight from SQLite."""
    con = sqlite3.connect(path)
    rows = con.execute("SELECT op, backend, host, status, count(*) FROM cases WHERE run_id = "
                       "(SELECT max(id) FROM runs WHERE kind = 'conformance') GROUP BY op, backend, host, status").fetchall()
    con.close()
    by = {}
    for op, backend, host, status, n in rows:
        by.setdefault((op, backend, host), {})[status] = n
    return {k: " ".join(f"{s} {c[s]}" for s in STATUSES if s in c) for k, c in by.items()}


@pytest.fixture(scope="module")
def page(stored_runs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("html")
    assert main(["report", stored_runs["db"], "--html", str(out)]) == 0
    return out / "index.html"


def test_the_page_loads_without_console_errors_and_cells_show_the_stored_counts(stored_runs, page, tmp_path):
    dom, console = chromium(page, tmp_path)
    assert console == []
    cells = Dom(dom).cells
    expected = stored_counts(stored_runs["db"])
    assert {k: " ".join(v[0].split()) for k, v in cells.items()} == expected
    assert "fail" in expected[("rmsnorm", "cpu", db.socket.gethostname())]  # run 2 broke rmsnorm: a red cell


def test_a_cell_opens_its_cases_with_their_repro_lines(stored_runs, page, tmp_path):
    host = db.socket.gethostname()
    first = Dom(page.read_text())
    assert first.panels and all(hidden for hidden, _ in first.panels.values())  # closed until a cell is clicked
    panel = first.cells[("rmsnorm", "cpu", host)][1]
    dom, console = chromium(page, tmp_path, f"#{panel}")  # what the cell's link does
    assert console == []
    panels = Dom(dom).panels
    assert [p for p, (hidden, _) in panels.items() if not hidden] == [panel]
    text = panels[panel][1]
    with db.Store(stored_runs["db"]) as store:
        mine = [c for c in store.cases(2) if c["op"] == "rmsnorm"]
    assert mine and all(c["id"] in text and c["repro"] in text for c in mine)


def test_console_errors_and_network_fetches_are_caught(page, tmp_path):
    """The check the page passes can fail: a script error, a fetch from the network, a script not the page's own."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!doctype html><html><body><script>notDefined()</script></body></html>")
    assert any("notDefined" in ln for ln in chromium(bad, tmp_path)[1])
    for extra in ('<img src="https://example.org/x.png">', "<script>document.title = 'injected'</script>"):
        spoilt = tmp_path / "spoilt.html"
        spoilt.write_text(page.read_text().replace("</body>", extra + "</body>"))
        dom, console = chromium(spoilt, tmp_path)
        assert any("Content Security Policy" in ln for ln in console), extra
        assert "injected" not in Dom(dom).title


def test_nothing_on_the_page_comes_from_the_network(page):
    text = page.read_text()
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//|url\(\s*["']?(?:https?:)?//|@import""", text)


def test_stored_strings_are_escaped(stored_runs, tmp_path):
    evil = "<script>document.title='pwned'</script>"
    report = copy.deepcopy(stored_runs["json"][1])
    report["hosts"] = {f'h"{evil}': {"note": evil}}
    for c in report["cases"]:
        c.update(host=f'h"{evil}', op=f"<b>{c['op']}</b>", message=f"{evil} & more", repro=f"{evil} '\"&")
    path = tmp_path / "evil.db"
    shutil.copy(stored_runs["db"], path)
    with db.Store(str(path)) as store:
        store.append("conformance", report, ["opport", evil], 0)
    assert main(["report", str(path), "--html", str(tmp_path / "out")]) == 0
    dom, console = chromium(tmp_path / "out" / "index.html", tmp_path)
    parsed = Dom(dom)
    assert console == [] and parsed.scripts == 1 and "pwned" not in parsed.title
    assert ("<b>rmsnorm</b>", "cpu", f'h"{evil}') in parsed.cells


def test_a_roofline_per_host_against_its_own_ceilings(stored_runs, tmp_path):
    report = copy.deepcopy(stored_runs["json"][3])
    base = report["ceilings"]
    report["hosts"] = {"fast-host": {"ceilings": {**base, "copy_GBps": 1000.0}},
                       "slow-host": {"ceilings": {**base, "copy_GBps": 3.0}}}
    for i, r in enumerate(report["rows"]):
        r["host"] = "fast-host" if i % 2 else "slow-host"
    path = tmp_path / "hosts.db"
    with db.Store(str(path), create=True) as store:
        store.append("bench", report, ["opport", "bench"], 0)
    assert main(["report", str(path), "--html", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "index.html").read_text()
    sections = dict(re.findall(r"<h3>host ([\w-]+) .*?</h3>(.*?)(?=<h3>|<h2>)", text, re.S))
    assert set(sections) == {"fast-host", "slow-host"}
    assert "<svg" in sections["fast-host"] and "roof: 1000 GB/s copy" in sections["fast-host"]
    assert "<svg" in sections["slow-host"] and "roof: 3 GB/s copy" in sections["slow-host"]
    assert "roof: 3 GB/s" not in sections["fast-host"]


def test_a_trend_per_op_across_runs(page):
    text = page.read_text()
    trend = text[text.index("<h2>Trend per op across runs</h2>"):]
    assert "<svg" in trend and all(f"<!-- {op} -->" in trend for op in ("rmsnorm", "rmsnorm_backward", "softmax"))


def test_bad_report_arguments_are_one_line(stored_runs, tmp_path, capsys):
    afile = tmp_path / "file"
    afile.write_text("")
    for argv, why in (([stored_runs["db"], "--html", str(afile)], "is a file"),
                      ([str(tmp_path / "none.db"), "--html", str(tmp_path / "o")], "no such file"),
                      ([stored_runs["db"], "--html", str(tmp_path / "o"), "--run", "42"], "run 42: no such run")):
        assert main(["report", *argv]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1
