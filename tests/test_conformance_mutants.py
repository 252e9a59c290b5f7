"""Gate sensitivity (docs/numerics.md G4): broken versions of every cpu kernel are each caught."""

import numpy as np

from opport.conformance import mutants
from opport.dispatch import backends
from opport.ops import all_ops, with_derived


def test_every_mutant_of_every_op_is_caught():
    """The five generic mutants of every op, training forward and backward, and every backward's declared
    mutants (dropped terms, gradients not summed over rows, wrong scales) each fail some case."""
    kills = mutants.self_test(examples=0)
    survivors = [key for key, case in kills.items() if case is None]
    assert not survivors, f"mutants not caught by any case: {survivors}"
    ops = with_derived(all_ops().values())
    want = {(s.name, m) for s in ops for m in mutants.MUTANTS} | {(s.name, m) for s in ops for m in getattr(s, "mutants", {})}
    assert set(kills) == want
    for spec in all_ops().values():  # every backward declares at least one plausible wrong backward
        assert spec.backward_op is None or spec.backward_op.mutants, f"{spec.name}: no backward mutant declared"
    assert not any(name.startswith("mutant-") for name in backends())  # removed again


def test_rmsnorm_offset_mutants_are_caught():
    """rmsnorm's offset (Gemma's 1 + weight): a forward that ignores it and a backward that drops it from dx are each
    caught by an offset case; rmsnorm's other mutants still are."""
    kills = mutants.self_test(ops=["rmsnorm"], examples=0)
    assert all(kills.values()), f"survivors: {[key for key, case in kills.items() if case is None]}"
    assert "/offset-" in kills[("rmsnorm", "offset-ignored")]
    assert "/offset-" in kills[("rmsnorm_backward", "offset-dropped-from-dx")]


def test_as_if_contiguous_reads_the_buffer_not_the_view():
    buf = np.arange(12.0).reshape(3, 4)
    assert mutants.as_if_contiguous(buf) is buf
    assert np.array_equal(mutants.as_if_contiguous(buf.T), np.arange(12.0).reshape(4, 3))
    assert np.array_equal(mutants.as_if_contiguous(buf[:, ::2]), [[0, 1], [2, 3], [4, 5]])
    stride0 = np.broadcast_to(np.arange(3.0), (4, 3))
    assert np.array_equal(mutants.as_if_contiguous(stride0), [[0, 1, 2]] + [[0, 0, 0]] * 3)  # never past the buffer


def test_as_if_contiguous_keeps_ml_dtypes_and_torch_tensors():
    import ml_dtypes
    import torch

    for dt in (ml_dtypes.bfloat16, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fn):
        buf = np.arange(12.0).astype(dt).reshape(3, 4)
        got = mutants.as_if_contiguous(buf.T)
        bits = f"u{buf.itemsize}"  # the buffer's elements in memory order, whatever their values round to
        assert got.dtype == buf.dtype and np.array_equal(got.view(bits), buf.reshape(4, 3).view(bits))
    t = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(mutants.as_if_contiguous(t.T), torch.arange(12.0).reshape(4, 3))
    assert torch.equal(mutants.as_if_contiguous(t[:, ::2]), torch.tensor([[0.0, 1], [2, 3], [4, 5]]))
    stride0 = torch.arange(3.0).expand(4, 3)
    assert torch.equal(mutants.as_if_contiguous(stride0), torch.tensor([[0.0, 1, 2]] + [[0.0] * 3] * 3))
