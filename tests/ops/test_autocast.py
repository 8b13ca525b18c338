"""The casts function handlers make under autocast, as torch's ops are handed their inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from physics_dp.ops.autocast import fp32_where_autocast_does, lower_precision


def test_lower_precision_casts_fp32_only_and_only_under_autocast() -> None:
    fp32, fp64, mask = torch.ones(2), torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.bool)
    assert lower_precision(fp32, None) == (fp32, None)  # autocast off: untouched
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast, kept, none, flags = lower_precision(fp32, fp64, None, mask)
        expected = F.linear(fp32[None], fp64.float()[None])  # torch's own cast of an fp32 operand
    assert cast.dtype == expected.dtype == torch.bfloat16
    assert kept is fp64 and none is None and flags is mask  # autocast leaves fp64 and non-floating tensors


def test_fp32_where_autocast_does_follows_torchs_policy_on_this_device() -> None:
    x = torch.ones(1, 2, 2, dtype=torch.bfloat16)  # the shape the probe is asked on
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for probe in (lambda t: F.group_norm(t, 1), lambda t: F.layer_norm(t, (2,)), torch.exp):
            assert fp32_where_autocast_does(x, probe).dtype == probe(x).dtype  # what torch's op returns
    assert fp32_where_autocast_does(x, torch.exp) is x  # autocast off: untouched
