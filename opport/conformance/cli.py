"""`opport conformance` (placeholder until the runner lands: it refuses to run rather than pass)."""


def add_arguments(p):
    p.add_argument("--backend", default="cpu")


def run(args) -> int:
    raise SystemExit("opport conformance: runner not built yet")
