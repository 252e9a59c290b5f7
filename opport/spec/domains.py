"""Dtype domains: what an array argument accepts, declared once as data.

An op's arrays take its `dtypes` (the floating dtypes that name a call) unless the declaration gives an
argument its own domain: `@op(arrays=(...), domains={"target": INDEX})`. Validation checks an argument against
its domain (`check_domain`), `opport explain` builds placeholder arrays from it, and the docs list it; a backend
declares the dtypes it runs once (`Backend(dtypes=...)`), and `@impl` restates dtypes only where a kernel
narrows them.
"""

from __future__ import annotations

from dataclasses import dataclass

from opport import errors
from opport.dtypes import FLOATS, INTS


@dataclass(frozen=True)
class Domain:
    """A set of dtypes with a name for messages ("an integer array (int32, int64)")."""

    name: str
    dtypes: tuple

    def describe(self) -> str:
        return f"{self.name} ({', '.join(self.dtypes)})"

    def example(self, preferred: str | None = None) -> str:
        """A dtype of this domain for a placeholder: `preferred` if it belongs, else the first."""
        return preferred if preferred in self.dtypes else self.dtypes[0]


FLOATING = Domain("a floating array", FLOATS)
INDEX = Domain("an integer array", INTS)
INT32 = Domain("an int32 array", ("int32",))
FLOAT32 = Domain("a float32 array", ("float32",))
FP8_CODES = Domain("an fp8 array", ("float8_e4m3fn", "float8_e5m2"))


def check_domain(op: str, arg: str, meta, domain: Domain, constraint: str | None = None) -> None:
    """Raise DTypeError `<op>.<arg>_dtype` (or `constraint`) unless `meta`'s dtype is in `domain`."""
    if meta is not None and meta.dtype not in domain.dtypes:
        raise errors.DTypeError(op=op, arg=arg, constraint=constraint or f"{op}.{arg}_dtype",
                                expected=domain.describe(), got=meta.dtype)
