"""`opport report DB --html OUT/` (docs/store.md 5), opened in a real headless browser: Debian's Chromium, driven
over the DevTools protocol (tests/browser.py).

The browser is required, never skipped: .ci/run installs it where it is missing. No host name resolves in
it, so a resource fetched from the network would be a console error too.
"""

from __future__ import annotations

import copy
import re
import shutil
import sqlite3
import sys

import pytest

from opport.cli import main
from opport.conformance.gate import STATUSES
from opport.store import db
from tests.browser import Chromium

CELLS = "[...document.querySelectorAll('td.cell[data-op]')].map(td => [td.dataset.op, td.dataset.backend, td.dataset.host, " \
        "td.innerText.split(/\\s+/).join(' ').trim(), td.querySelector('a').getAttribute('href').slice(1)])"
OPEN_PANELS = "[...document.querySelectorAll('section.cases')].filter(s => s.offsetParent !== null).map(s => s.id)"


def stored_counts(path: str, run_id: int | None = None) -> dict:
    """{(op, backend, host): 'pass 20 fail 3'} of a conformance run (the latest), straight from SQLite."""
    con = sqlite3.connect(path)
    rows = con.execute("SELECT op, backend, host, status, count(*) FROM cases WHERE run_id = "
                       "coalesce(?, (SELECT max(id) FROM runs WHERE kind = 'conformance')) GROUP BY op, backend, host, status",
                       (run_id,)).fetchall()
    con.close()
    by = {}
    for op, backend, host, status, n in rows:
        by.setdefault((op, backend, host), {})[status] = n
    return {k: " ".join(f"{s} {c[s]}" for s in STATUSES if s in c) for k, c in by.items()}


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    try:
        with Chromium(tmp_path_factory.mktemp("chromium-profile")) as b:
            yield b
    except RuntimeError as e:  # no chromium: a failure, never a skip
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def page(stored_runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("html")
    assert main(["report", stored_runs["db"], "--html", str(out)]) == 0
    return out / "index.html"


def test_the_page_loads_without_console_errors_and_cells_show_the_stored_counts(stored_runs, page, browser):
    tab = browser.open(page)
    cells = {(op, b, h): text for op, b, h, text, _ in tab.eval(CELLS)}
    assert tab.console_errors() == []
    expected = stored_counts(stored_runs["db"])
    assert cells == expected
    assert "fail" in expected[("rmsnorm", "cpu", db.socket.gethostname())]  # run 2 broke rmsnorm: a red cell


def test_clicking_a_cell_shows_its_cases_with_their_repro_lines(stored_runs, page, browser):
    tab = browser.open(page)
    assert tab.eval(OPEN_PANELS) == []  # closed until a cell is clicked
    for op, backend, host, _, panel in tab.eval(CELLS):
        tab.eval(f"document.querySelector('td.cell a[href=\"#{panel}\"]').click()")
        assert tab.eval(OPEN_PANELS) == [panel]
        text = tab.eval(f"document.getElementById('{panel}').innerText")
        with db.Store(stored_runs["db"]) as store:
            mine = [c for c in store.cases(2) if (c["op"], c["backend"], c["host"]) == (op, backend, host)]
        assert mine and all(c["id"] in text and c["repro"] in text for c in mine)
    assert tab.console_errors() == []


def test_run_picks_the_run_shown(stored_runs, browser, tmp_path):
    assert main(["report", stored_runs["db"], "--html", str(tmp_path), "--run", "1"]) == 0
    cells = {(op, b, h): text for op, b, h, text, _ in browser.open(tmp_path / "index.html").eval(CELLS)}
    assert cells == stored_counts(stored_runs["db"], 1) != stored_counts(stored_runs["db"])


def test_a_link_to_a_cell_opens_it(stored_runs, page, browser):
    first = browser.open(page).eval(CELLS)[0]
    assert browser.open(page, f"#{first[4]}").eval(OPEN_PANELS) == [first[4]]


def test_console_errors_and_network_fetches_are_caught(page, browser, tmp_path):
    """The check the page passes can fail: a script error, a fetch from the network, a script not the page's own."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!doctype html><html><body><script>notDefined()</script></body></html>")
    assert any("notDefined" in e for e in browser.open(bad).console_errors())
    for extra in ('<img src="https://example.org/x.png">', "<script>document.title = 'injected'</script>"):
        spoilt = tmp_path / "spoilt.html"
        spoilt.write_text(page.read_text().replace("</body>", extra + "</body>"))
        tab = browser.open(spoilt)
        assert any("Content Security Policy" in e for e in tab.console_errors()), extra
        assert "injected" not in tab.eval("document.title")


def test_nothing_on_the_page_comes_from_the_network(page):
    text = page.read_text()
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//|url\(\s*["']?(?:https?:)?//|@import""", text)


def test_stored_strings_are_escaped(stored_runs, browser, tmp_path):
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
    tab = browser.open(tmp_path / "out" / "index.html")
    assert tab.console_errors() == [] and tab.eval("document.scripts.length") == 1
    assert "pwned" not in tab.eval("document.title")
    assert ["<b>rmsnorm</b>", "cpu", f'h"{evil}'] in [c[:3] for c in tab.eval(CELLS)]
    assert evil in tab.eval("document.querySelector('section.cases').innerText")


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


def test_without_matplotlib_the_report_says_how_to_get_it(stored_runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a base install has: import fails
    assert main(["report", stored_runs["db"], "--html", str(tmp_path)]) == 2
    assert "pip install 'opport[bench]'" in capsys.readouterr().err and not (tmp_path / "index.html").exists()
