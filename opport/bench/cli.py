"""`opport bench` (placeholder until the suite lands: it refuses to run rather than report)."""


def add_arguments(p):
    p.add_argument("--backend", default="cpu")


def run(args) -> int:
    raise SystemExit("opport bench: suite not built yet")
