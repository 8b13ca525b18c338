"""One rank's failure becomes the same error on every rank, at the same point."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from physics_dp.distributed.agreement import on_rank0, raise_together
from physics_dp.testing import run_on_ranks


class _Unpicklable(Exception):
    def __init__(self, a, b):  # pickle calls __init__(msg) only: this one cannot be restored
        super().__init__(f"{a}/{b}")


def _rank0_result_or_error(fail: str | None) -> str:
    def action():
        if fail == "plain":
            raise PermissionError("rank 0 cannot write /run/dir")
        if fail == "unpicklable":
            raise _Unpicklable("x", "y")
        return f"value of rank {dist.get_rank()}"

    try:
        return on_rank0(action)
    except Exception as error:
        return f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("fail, expected", [(None, "value of rank 0"), ("plain", "PermissionError: rank 0 cannot write /run/dir"),
                                            ("unpicklable", "RuntimeError: _Unpicklable: x/y")])
def test_on_rank0_shares_the_result_or_the_error(fail, expected):
    messages = run_on_ranks(3, _rank0_result_or_error, fail)
    assert messages[1:] == [expected, expected], messages
    assert messages[0] == (expected if fail != "unpicklable" else "_Unpicklable: x/y")


def _lowest_failure_wins(failing: list[int]) -> str:
    rank = dist.get_rank()
    try:
        raise_together(ValueError(f"bad input on rank {rank}") if rank in failing else None)
    except ValueError as error:
        return str(error)
    return "no error"


def test_raise_together_raises_the_lowest_failing_ranks_error_everywhere():
    assert run_on_ranks(3, _lowest_failure_wins, [2, 1]) == ["bad input on rank 1", "bad input on rank 1", "bad input on rank 2"]
    assert run_on_ranks(3, _lowest_failure_wins, []) == ["no error"] * 3
