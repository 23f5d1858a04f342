"""moe_ops._runtime.library.destination_op: schema, generated fake, version counters, per-key kernels."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moe_ops._runtime.library import destination_op


def _fill(out: torch.Tensor, value: int) -> None:
    out.fill_(value)


def test_schema_mutation_and_fake():
    op = destination_op("test_fill_", mutates=("out",), cpu=_fill)
    assert str(op.default._schema) == "moe_ops::test_fill_(Tensor(a0!) out, SymInt value) -> ()"
    out = torch.zeros(3, dtype=torch.int32)
    version = out._version
    op(out, 7)
    assert out.tolist() == [7, 7, 7]
    assert out._version > version  # autograd sees the write
    with FakeTensorMode():
        fake = torch.empty(3, dtype=torch.int32)
        assert op(fake, 1) is None  # the generated fake: traces without running the body
    torch.library.opcheck(op.default, (torch.zeros(4), 2))
    compiled = torch.compile(lambda t: op(t, 5), fullgraph=True, backend="aot_eager")
    compiled(out)
    assert out.tolist() == [5, 5, 5]


def test_declared_mutations_must_match_the_schema():
    with pytest.raises(ValueError, match="mutates"):
        destination_op("test_wrong_", mutates=("out",), cpu=_fill, schema="(Tensor out, int value) -> ()")
    with pytest.raises(ValueError, match="returns nothing"):
        destination_op("test_ret_", mutates=(), cpu=_fill, schema="(Tensor out, int value) -> Tensor")
    assert "moe_ops::test_wrong_" not in torch._C._dispatch_get_all_op_names()  # nothing defined
