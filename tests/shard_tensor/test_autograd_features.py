"""Autograd features (not ops) with ShardTensors: each equals one device's result, or raises
clearly on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from physics_dp.shard_tensor import Shard, ShardTensor, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

# (mesh shape, placements, split sizes) of a (2, 3, 7, 5) input
LAYOUTS = {
    "2 ranks [2, 5]": ((2,), [Shard(2)], {0: [2, 5]}),
    "3 ranks [3, 0, 4]": ((3,), [Shard(2)], {0: [3, 0, 4]}),
    "2x2 mesh": ((2, 2), [Shard(2), Shard(3)], None),
    "1 rank": ((1,), [Shard(2)], None),
}


def _world(layout: str) -> int:
    return int(torch.tensor(LAYOUTS[layout][0]).prod())


def _inputs(layout: str, seed: int = 0):
    mesh_shape, placements, sizes = LAYOUTS[layout]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(seed)
    g = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    return g, distribute_tensor(g, mesh, placements, sizes)


def _conv() -> nn.Conv2d:
    torch.manual_seed(1)
    return nn.Conv2d(3, 4, 3, padding=1).double()


def _forward_ad_raises(layout: str) -> list[str]:
    g, x = _inputs(layout)
    errors = []
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="forward-mode AD") as info:
            fwAD.make_dual(x, x.detach().clone())  # on one rank this lost the tangent silently
        errors.append(str(info.value))
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda t: t.sin(), (x,), (x,))
    # the reverse-mode jvp that the message suggests works
    m = _conv()
    out, jvp = torch.autograd.functional.jvp(m, x, x)
    out_ref, jvp_ref = torch.autograd.functional.jvp(m, g, g)
    torch.testing.assert_close(out.full_tensor(), out_ref)
    torch.testing.assert_close(jvp.full_tensor(), jvp_ref)
    return errors


@pytest.mark.parametrize("layout", ["1 rank", "3 ranks [3, 0, 4]"])
def test_forward_mode_ad_raises_clearly_on_every_rank(layout):
    messages = run_on_ranks(_world(layout), _forward_ad_raises, layout)
    assert all(m == messages[0] for m in messages)


def _anomaly_nan_check(layout: str) -> bool:
    g, x = _inputs(layout)
    m = _conv()
    x.requires_grad_(True)
    with torch.autograd.detect_anomaly(check_nan=True):  # its NaN checks on sharded gradients
        (m(x) ** 2).sum().backward()
    ref = _conv()
    g = g.clone().requires_grad_(True)
    (ref(g) ** 2).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), g.grad)
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)
    # a NaN in the last row: on one rank's slab only; every rank must raise
    w = torch.ones(2, 4, 7, 5, dtype=torch.float64)
    w[0, 0, 6, 0] = float("nan")
    mesh_shape, placements, sizes = LAYOUTS[layout]
    w = distribute_tensor(w, x.device_mesh, placements, sizes)
    with pytest.raises(RuntimeError, match="nan"):
        with torch.autograd.detect_anomaly(check_nan=True):
            (m(x) * w).sum().backward()
    return True


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.filterwarnings("ignore:Error detected in")
@pytest.mark.parametrize("layout", ["2 ranks [2, 5]", "2x2 mesh"])
def test_anomaly_detection_checks_sharded_gradients_on_every_rank(layout):
    run_on_ranks(_world(layout), _anomaly_nan_check, layout)


def _parameter_hooks(layout: str) -> bool:
    g, x = _inputs(layout)
    results = []
    for data in (x, g):
        m, seen = _conv(), {}
        m.weight.register_hook(lambda grad: grad * 2)
        m.bias.register_post_accumulate_grad_hook(lambda p: seen.update(bias=p.grad.clone()))
        (m(data).tanh() ** 2).sum().backward()
        results.append((m.weight.grad, seen["bias"], m.bias.grad))
    for actual, expected in zip(*results):
        assert type(actual) is torch.Tensor
        torch.testing.assert_close(actual, expected)
    return True


@pytest.mark.parametrize("layout", ["2 ranks [2, 5]", "2x2 mesh"])
def test_parameter_hooks_see_the_whole_gradient(layout):
    run_on_ranks(_world(layout), _parameter_hooks, layout)


def _backward_after_a_failed_backward(layout: str) -> bool:
    g, x = _inputs(layout)
    m = _conv()
    h = x.requires_grad_(True) * 1.0
    h.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("user hook failed")))
    with pytest.raises(RuntimeError, match="user hook failed"):
        (m(h) ** 2).sum().backward()  # the weight's share was stashed before the hook raised
    m.zero_grad()
    x.grad = None
    (m(x) ** 2).sum().backward()
    ref = _conv()
    (ref(g) ** 2).sum().backward()
    assert m.weight.grad is not None
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)
    torch.testing.assert_close(m.bias.grad, ref.bias.grad)
    return True


@pytest.mark.parametrize("layout", ["2 ranks [2, 5]", "3 ranks [3, 0, 4]"])
def test_a_failed_backward_leaves_later_parameter_gradients_exact(layout):
    run_on_ranks(_world(layout), _backward_after_a_failed_backward, layout)


class _SquareWithPlainGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return (2 * grad * x).full_tensor()  # a plain tensor of the global shape


def _plain_gradients(layout: str) -> bool:
    g, x = _inputs(layout)
    torch.manual_seed(4)
    cotangent = torch.randn(2, 4, 7, 5, dtype=torch.float64)
    m, ref = _conv(), _conv()
    x.requires_grad_(True)
    m(x).backward(cotangent)  # a plain gradient for a sharded output
    g_leaf = g.clone().requires_grad_(True)
    ref(g_leaf).backward(cotangent)
    torch.testing.assert_close(x.grad.full_tensor(), g_leaf.grad)
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)
    m.zero_grad()
    ref.zero_grad()
    x.grad = g_leaf.grad = None
    _SquareWithPlainGradient.apply(m(x)).sum().backward()
    (ref(g_leaf) ** 2).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), g_leaf.grad)
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)
    assert isinstance(x.grad, ShardTensor)
    return True


@pytest.mark.parametrize("layout", ["2 ranks [2, 5]", "2x2 mesh"])
def test_plain_global_gradient_for_a_sharded_output(layout):
    run_on_ranks(_world(layout), _plain_gradients, layout)
