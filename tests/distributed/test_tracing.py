"""tracing: ``is_tracing`` under each kind of trace; ``kept_in_backward``: every rank's compiled
graphs hold the same collectives in the same order.

A rank whose output piece is empty has a backward that depends on no tangent data once inductor's
decompositions and joint-graph passes fold its empty tensors into constants.  Without the tag,
the partitioner moved that rank's backward all-reduces into its forward graph, and the step hung
(ranks 0 and 1 in the loss, rank 2 in a parameter-gradient sum).  The graphs are partitioned as
inductor partitions them and recorded, without its code generation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from physics_dp.distributed.tracing import is_tracing
from physics_dp.shard_tensor import Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

pytestmark = pytest.mark.usefixtures("fresh_rank_processes")


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return func(*args, **(kwargs or {}))


def test_is_tracing_under_each_kind_of_trace_and_not_eagerly() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    seen = []

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append(is_tracing())
        return x + 1

    assert not is_tracing()
    with FakeTensorMode():
        assert is_tracing()
    make_fx(record)(torch.ones(2))
    make_fx(record, pre_dispatch=True)(torch.ones(2))
    make_fx(record, tracing_mode="fake")(torch.ones(2))
    torch.compile(record, backend="eager", fullgraph=True)(torch.ones(2))
    assert seen == [True, True, True, True]
    with _Passthrough():  # a dispatch mode that traces nothing (a profiler, a FLOP counter)
        assert not is_tracing()
    assert not is_tracing()


def pools_down_to_fewer_rows_than_ranks() -> nn.Module:
    """11 rows on 3 ranks (4/4/3): the last pool leaves 2 output rows, so rank 2 holds none."""
    return nn.Sequential(
        nn.MaxPool2d(3, stride=1, padding=1),
        nn.Conv2d(2, 2, 3, padding=1),
        nn.AvgPool2d(2),
        nn.Conv2d(2, 2, 3, padding=1),
        nn.AdaptiveAvgPool2d((3, 3)),
        nn.Conv2d(2, 2, 3, padding=1),
        nn.MaxPool2d(2, stride=2, ceil_mode=True),
    )


def _collectives_in_graphs() -> dict:
    import torch._dynamo
    import torch._inductor.compile_fx as inductor_compile
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    mesh = get_mesh((3,))
    graphs: dict[str, list[str]] = {}

    def recorder(tag: str):
        def compiler(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
            graphs[tag] = [
                node.target.__name__ for node in gm.graph.nodes
                if node.op == "call_function" and "_c10d_functional" in str(node.target)
            ]
            return gm

        return compiler

    backend = aot_autograd(
        fw_compiler=recorder("forward"), bw_compiler=recorder("backward"),
        partition_fn=inductor_compile.partition_fn, decompositions=select_decomp_table(),
    )
    torch.manual_seed(0)
    model = pools_down_to_fewer_rows_than_ranks()
    x = distribute_tensor(torch.randn(1, 2, 11, 6), mesh, [Shard(2)]).requires_grad_()
    torch._dynamo.reset()
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
    return {"rows": out.to_local().shape[2], **graphs}


def test_every_rank_issues_the_same_collectives_when_one_holds_no_output_rows() -> None:
    results = run_on_ranks(3, _collectives_in_graphs, timeout=120)
    assert [r["rows"] for r in results] == [1, 1, 0]
    assert results[0]["backward"].count("all_reduce.default") >= 2  # the parameter-gradient sums
    for result in results:
        assert "all_reduce.default" not in result["forward"], result
        assert result["forward"] == results[0]["forward"] and result["backward"] == results[0]["backward"], results
