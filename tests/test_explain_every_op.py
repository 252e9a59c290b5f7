"""`opport explain OP ...` from the command line works for every registered op, derived ops included: the shapes
and dtypes come from the op's first declared case, so a new op cannot be unexplainable."""

import numpy as np
import pytest

from opport.cli import main
from opport.ops import all_ops, with_derived


def _argv(spec) -> list:
    case = next(iter(spec.get_cases("float32")))
    bound = spec.bind(*case.args, **case.kwargs)
    argv = ["explain", spec.name, "--backend", "cpu", "--dtype", "float32"]
    for i in spec.array_pos:
        a = bound[i]
        argv += ["--shape", "none" if a is None else (",".join(map(str, a.shape)) or "()")]
        if a is not None and np.dtype(a.dtype).name != "float32":
            argv += ["--arg-dtype", f"{spec.params[i]}={np.dtype(a.dtype).name}"]
    defaults = [p.default for p in spec.signature.parameters.values()]
    for i in spec.scalar_pos:
        if bound[i] is not defaults[i] and bound[i] != defaults[i]:
            argv += ["--arg", f"{spec.params[i]}={bound[i]!r}"]
    return argv


@pytest.mark.parametrize("spec", with_derived(all_ops().values()), ids=lambda s: s.name)
def test_explain_every_op(spec, capsys):
    argv = _argv(spec)
    assert main(argv) == 0, " ".join(argv)
    assert spec.name.split("_value_and_grad")[0] in capsys.readouterr().out
