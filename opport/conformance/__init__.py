"""The conformance suite: every kernel against the op's float64 reference, isolated, reported, gated.

    from opport.conformance import Options, run
    report = run(Options(backends=("cpu",), ops=("rmsnorm",)))
    report.summary, report.exit_code, report.cases

Pieces, in the order a case flows through them: `cases` (what runs: fixed cases, layout variants,
Hypothesis examples, bad inputs), `execute` (one case: strict dispatch, poisoned outputs, checksums,
repeats), `compare` (dtype/shape, special values, tolerance metrics, noise floor), `worker` (crash
isolation), `gate` (known failures, baseline, exit code), `report` (terminal, JSON, JUnit, Markdown),
`runner` (plans and runs it all), `mutants` and `faults` (the suite's own self-test), `pytest_plugin`.
"""

from opport.conformance.runner import Options, Report, run

__all__ = ["Options", "Report", "run"]
