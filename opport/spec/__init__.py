"""The op declaration machinery.

An op is declared once, in `opport/ops/<name>.py`, by decorating its validation function:

    @op(arrays=("x", "weight"), constraints={"rmsnorm.weight_shape": "weight.shape == (x.shape[-1],)"})
    def rmsnorm(x, weight=None, eps=1e-6):
        ...  # validation only: array arguments arrive as `Meta` (shape, dtype, device), never data

and then attaching the rest to the returned `OpSpec`, in any order:

    @rmsnorm.reference      # NumPy float64 reference, takes float64 arrays
    @rmsnorm.cases          # fixed conformance cases for one dtype
    @rmsnorm.strategy       # Hypothesis strategy of cases for one dtype
    @rmsnorm.error_cases    # one bad input per declared constraint
    @rmsnorm.cost           # bytes moved and FLOPs, from metas
    @rmsnorm.backward(...)  # its vector-Jacobian product: a derived spec, `rmsnorm_backward`

The package: records.py (Meta, Tolerance, Cost, Case, ErrorCase), domains.py (the dtypes each argument
accepts), checks.py (validation helpers raising typed errors), base.py (what every spec answers),
opspec.py (a declared op and `op`), derived.py (backward, training forward, fused value-and-grad).
It is pure declaration: it imports neither the dispatcher nor any backend. Backends register kernels for a
declared op with `@impl(rmsnorm, "cuda", supports=...)` (opport.dispatch), and `opport.rmsnorm(x, w)` is a
plain function generated from the declaration (opport/_ops.py, opport/public.py) that hands its arguments to
the dispatcher.
"""

from opport.spec.base import Spec
from opport.spec.checks import (
    GRAD_CONSTRAINTS,
    SCALE_MAX,
    WINDOW_MAX,
    check,
    check_axis,
    check_bool,
    check_choice,
    check_eps,
    check_float,
    check_grad,
    check_ndim,
    check_same_dtype,
    check_scale,
    check_softcap_window,
    fail,
    grad_constraints,
)
from opport.spec.derived import BackwardSpec, TrainForwardSpec, ValueAndGradSpec
from opport.spec.domains import FLOAT32, FLOATING, FP8_CODES, INDEX, INT32, Domain, check_domain
from opport.spec.opspec import OpSpec, op
from opport.spec.records import BASE_TOLERANCE, Case, Cost, ErrorCase, Meta, Tolerance, contiguous_strides

__all__ = [
    "BASE_TOLERANCE", "FLOAT32", "FLOATING", "FP8_CODES", "GRAD_CONSTRAINTS", "INDEX", "INT32", "BackwardSpec",
    "Case", "Cost", "Domain", "ErrorCase", "Meta", "OpSpec", "Spec", "Tolerance", "TrainForwardSpec",
    "ValueAndGradSpec", "SCALE_MAX", "WINDOW_MAX", "check", "check_axis", "check_scale", "check_softcap_window",
    "check_bool", "check_choice", "check_domain", "check_eps", "check_float", "check_grad", "check_ndim",
    "check_same_dtype", "contiguous_strides", "fail", "grad_constraints", "op",
]
