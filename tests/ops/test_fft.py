"""torch.fft transforms over sharded dims (pencil decomposition) equal one device, forward and backward.

Complex, real and Hermitian transforms (``hfft*`` / ``ihfft*``: before, torch's composites ran on
each slab, and the rank of an empty shard raised in MKL while the others went on).

Every transform runs on 1-4 ranks sharding H and on a 2x2 mesh sharding H and W, with even,
uneven and skewed (empty shard) splits; complex outputs are compared through ``view_as_real``.
Traffic: fft2 of an H-sharded grid on a 1-D mesh is two all-to-alls forward and two backward,
and a transform over unsharded dims sends nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops.fft import FFTPlan, _local_fft
from physics_dp.shard_tensor import Replicate, Shard, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks

from .test_shape_ops import LAYOUTS, SHAPES, check_family, randn, sharding, world_of

real = torch.view_as_real


def _complex(x: torch.Tensor) -> torch.Tensor:
    """A complex tensor from a real one, so that complex-input transforms get real-input gradients."""
    return torch.complex(x, 0.5 * x + 1)


FORWARD_FAMILY: dict[str, Callable] = {
    "fft2": lambda x: real(torch.fft.fft2(x)),
    "fft2(norm=ortho)": lambda x: real(torch.fft.fft2(x, norm="ortho")),
    "fft2(dim=(3, 2))": lambda x: real(torch.fft.fft2(x, dim=(3, 2))),
    "fft2(s=(6, 9))": lambda x: real(torch.fft.fft2(x, s=(6, 9))),
    "fftn()": lambda x: real(torch.fft.fftn(x)),
    "fftn(dim=(1, 2))": lambda x: real(torch.fft.fftn(x, dim=(1, 2), norm="forward")),
    "fftn(s=(4, -1), dim=(2, 3))": lambda x: real(torch.fft.fftn(x, s=(4, -1), dim=(2, 3))),
    "fft(dim=2)": lambda x: real(torch.fft.fft(x, dim=2)),
    "fft(n=10, dim=-2)": lambda x: real(torch.fft.fft(x, n=10, dim=-2)),
    "fft(fft(dim=1), dim=2)": lambda x: real(torch.fft.fft(torch.fft.fft(x, dim=1), dim=2)),
}
INVERSE_FAMILY: dict[str, Callable] = {
    "ifft2": lambda x: real(torch.fft.ifft2(_complex(x))),
    "ifft2(norm=forward)": lambda x: real(torch.fft.ifft2(x, norm="forward")),
    "ifftn(s=(6, 9), dim=(2, 3))": lambda x: real(torch.fft.ifftn(_complex(x), s=(6, 9), dim=(2, 3))),
    "ifftn(dim=(0, 2, 3), norm=ortho)": lambda x: real(torch.fft.ifftn(_complex(x), dim=(0, 2, 3), norm="ortho")),
    "ifft2(fft2)": lambda x: real(torch.fft.ifft2(torch.fft.fft2(x) * 2)),
    "ifft(dim=2)": lambda x: real(torch.fft.ifft(_complex(x), dim=2)),
}
REAL_FAMILY: dict[str, Callable] = {
    "rfft2": lambda x: real(torch.fft.rfft2(x)),
    "rfft2(norm=ortho)": lambda x: real(torch.fft.rfft2(x, norm="ortho")),
    "rfft2(dim=(3, 2))": lambda x: real(torch.fft.rfft2(x, dim=(3, 2))),
    "rfftn(s=(5, 8), dim=(2, 3))": lambda x: real(torch.fft.rfftn(x, s=(5, 8), dim=(2, 3))),
    "rfftn()": lambda x: real(torch.fft.rfftn(x)),
    "rfft(dim=2)": lambda x: real(torch.fft.rfft(x, dim=2)),
    "irfft2": lambda x: torch.fft.irfft2(_complex(x)),
    "irfft2(rfft2, s)": lambda x: torch.fft.irfft2(torch.fft.rfft2(x) * 1.5, s=(x.shape[2], x.shape[3])),
    "irfftn(dim=(1, 2, 3), norm=forward)": lambda x: torch.fft.irfftn(_complex(x), dim=(1, 2, 3), norm="forward"),
    "irfftn(s=(6, 7), dim=(3, 2))": lambda x: torch.fft.irfftn(_complex(x), s=(6, 7), dim=(3, 2)),
    "irfft(n=9, dim=2)": lambda x: torch.fft.irfft(_complex(x), n=9, dim=2),
    "irfft(dim=-1)": lambda x: torch.fft.irfft(_complex(x), dim=-1),
}
HERMITIAN_FAMILY: dict[str, Callable] = {
    "hfft(dim=-1)": lambda x: torch.fft.hfft(_complex(x), dim=-1),
    "hfft(n=9, dim=2, norm=ortho)": lambda x: torch.fft.hfft(_complex(x), n=9, dim=2, norm="ortho"),
    "ihfft(dim=2)": lambda x: real(torch.fft.ihfft(x, dim=2).resolve_conj()),  # torch's 1-D one is a conjugate view
    "hfft2": lambda x: torch.fft.hfft2(_complex(x)),
    "ihfft2(norm=forward)": lambda x: real(torch.fft.ihfft2(x, norm="forward")),
    "hfftn(s=(6, 7), dim=(3, 2))": lambda x: torch.fft.hfftn(_complex(x), s=(6, 7), dim=(3, 2)),
    "ihfftn(dim=(1, 2, 3))": lambda x: real(torch.fft.ihfftn(x, dim=(1, 2, 3))),
}
FAMILIES = {"forward": FORWARD_FAMILY, "inverse": INVERSE_FAMILY, "real": REAL_FAMILY, "hermitian": HERMITIAN_FAMILY}


def _check(layout: str, family: str) -> list[str]:
    return check_family(layout, FAMILIES[family])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fft_matches_single_device(layout: str, family: str) -> None:
    checked = run_on_ranks(world_of(layout), _check, layout, family)[0]
    assert len(checked) == len(SHAPES) * len(FAMILIES[family])


# ----- placements and communication -----------------------------------------------------------------------------
def _fft2_is_two_all_to_alls(world: int) -> None:
    mesh, placements, sizes = sharding(str(world), "skewed", (2, 3, 7, 5))
    x = distribute_tensor(randn((2, 3, 7, 5)), mesh, placements, sizes).requires_grad_(True)
    with count_communication() as log:
        y = torch.fft.fft2(x)
    assert log.kinds() == ["all_to_all", "all_to_all"], log.kinds()
    assert y.placements == x.placements and y._spec.axis_sizes == x._spec.axis_sizes
    cotangent = distribute_tensor(torch.randn(y.shape, dtype=y.dtype), mesh, placements, sizes)
    with count_communication() as log:
        y.backward(cotangent)
    assert log.kinds() == ["all_to_all", "all_to_all"], log.kinds()
    assert x.grad._spec == x._spec


def _rfft2_resplits_the_halved_dim() -> None:
    mesh = get_mesh((4,))
    x = distribute_tensor(randn((2, 3, 6, 9)), mesh, [Shard(3)], {0: (0, 2, 2, 5)})
    with count_communication() as log:
        y = torch.fft.rfft2(x)
    # W: 9 -> 5 columns, rebalanced; H takes the axis for the W transform and hands it back
    assert y.shape == (2, 3, 6, 5) and y._spec.axis_sizes == ((2, 1, 1, 1),)
    assert log.kinds() == ["all_to_all", "all_to_all"], log.kinds()


def _whole_dims_send_nothing() -> None:
    mesh = get_mesh((2, 2))
    x = distribute_tensor(randn((4, 3, 7, 6)), mesh, [Shard(0), Replicate()], {0: (1, 3)})
    with count_communication() as log:
        y = torch.fft.rfftn(x, dim=(1, 2, 3), norm="ortho")
        z = torch.fft.irfft(torch.fft.fft(y, dim=2), n=6, dim=3)
    assert log.calls == 0, log.kinds()
    assert z.placements == x.placements and z._spec.axis_sizes == x._spec.axis_sizes


def _hermitian_transforms_send_what_the_real_ones_send() -> None:
    """hfft2 / ihfft2 of an H-sharded grid: the all-to-alls and bytes of irfft2 / rfft2, nothing
    gathered; along an unsharded dim (an empty shard included) nothing is sent."""
    mesh = get_mesh((4,))
    split = {0: (3, 0, 2, 3)}
    z = distribute_tensor(_complex(randn((2, 3, 8, 5))), mesh, [Shard(2)], split)
    x = distribute_tensor(randn((2, 3, 8, 5)), mesh, [Shard(2)], split)
    for hermitian, real_one, t in ((torch.fft.hfft2, torch.fft.irfft2, z), (torch.fft.ihfft2, torch.fft.rfft2, x)):
        with count_communication() as expected:
            real_one(t)
        with count_communication() as log:
            hermitian(t)
        assert log.kinds() == expected.kinds() == ["all_to_all", "all_to_all"], (log.kinds(), expected.kinds())
        assert log.bytes_sent == expected.bytes_sent, (log.bytes_sent, expected.bytes_sent)
    with count_communication() as log:
        torch.fft.hfft(z, dim=-1)
        torch.fft.ihfft(x, dim=3)
    assert log.calls == 0, log.kinds()


def _two_d_grid_replicates_one_axis() -> None:
    mesh = get_mesh((2, 2))
    x = distribute_tensor(randn((7, 6)), mesh, [Shard(0), Shard(1)])
    with count_communication() as log:
        y = torch.fft.fft2(x)
    assert y.placements == x.placements
    assert torch.allclose(y.full_tensor(), torch.fft.fft2(randn((7, 6))), atol=1e-5)
    assert "all_to_all" in log.kinds()


def _real_data_moves_before_it_turns_complex(mesh_shape: tuple, shape: tuple) -> tuple[float, float]:
    mesh = get_mesh(mesh_shape)
    placements = [Shard(2)] if len(mesh_shape) == 1 else [Shard(2), Shard(3)]
    full = randn(shape)
    x = distribute_tensor(full, mesh, placements).requires_grad_(True)
    with count_communication() as forward:
        y = torch.fft.fft2(x)
    with count_communication() as backward:
        y.abs().backward(torch.ones(y.shape))
    assert torch.allclose(y.full_tensor(), torch.fft.fft2(full), atol=1e-4)
    slab = full.numel() * full.element_size() / mesh.size()
    return forward.bytes_sent / slab, backward.bytes_sent / slab


@pytest.mark.parametrize(
    "mesh_shape, shape, slabs",
    [((2,), (1, 1, 8, 6), 1.5), ((2, 2), (1, 8, 8, 12), 3.0)],
    ids=["no batch dim, 2 ranks", "one batch dim, 2x2"],
)
def test_fft2_of_real_data_moves_it_while_real(mesh_shape, shape, slabs) -> None:
    """Moves before the first transform carry real values, half a complex value's bytes: 1.5 slabs
    each way instead of 2 (H -> W real, W -> H complex); 3 instead of 3.5 on the 2x2 mesh."""
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1)
    for forward, backward in run_on_ranks(world, _real_data_moves_before_it_turns_complex, mesh_shape, shape):
        assert forward == pytest.approx(slabs) and backward == pytest.approx(slabs), (forward, backward)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fft2_uses_two_all_to_alls(world: int) -> None:
    run_on_ranks(world, _fft2_is_two_all_to_alls, world)


@pytest.mark.parametrize(
    "check",
    [
        _rfft2_resplits_the_halved_dim, _whole_dims_send_nothing, _two_d_grid_replicates_one_axis,
        _hermitian_transforms_send_what_the_real_ones_send,
    ],
    ids=lambda f: f.__name__,
)
def test_fft_layouts(check) -> None:
    run_on_ranks(4, check)


def test_fft_plan_orders_real_transforms() -> None:
    rfft = FFTPlan("rfft", (1, 2, 3), (3, 7, 5), None)
    assert rfft.allowed([1, 2, 3]) == [3] and rfft.allowed([1, 2]) == [1, 2] and rfft.out_extent(3) == 3
    irfft = FFTPlan("irfft", (2, 3), (7, 8), None)
    assert irfft.allowed([2, 3]) == [2] and irfft.allowed([3]) == [3] and irfft.out_extent(3) == 8


@pytest.mark.parametrize("norm", [None, "ortho", "forward"])
@pytest.mark.parametrize("dims", [(2, 3), (3, 1), (2,)])
def test_real_slab_is_transformed_without_a_complex_copy(norm: str | None, dims: tuple[int, ...]) -> None:
    """fft of a real slab runs aten's two-sided real-to-complex transform: no copy of the slab to
    complex first, and the result and its gradient equal ``torch.fft.fftn``."""
    x = randn((2, 3, 6, 5)).double().requires_grad_(True)
    plan = FFTPlan("fft", dims, tuple(x.shape[d] for d in dims), norm)
    with torch.profiler.profile() as prof:
        ours = _local_fft(x, plan, list(dims))
    ops = {event.name for event in prof.events()}
    assert "aten::_fft_r2c" in ops and "aten::_to_copy" not in ops
    reference = torch.fft.fftn(x, dim=dims, norm=norm)
    torch.testing.assert_close(ours, reference)
    cotangent = torch.randn(reference.shape, dtype=reference.dtype, generator=torch.Generator().manual_seed(1))
    (ours_grad,) = torch.autograd.grad(ours, x, cotangent)
    (reference_grad,) = torch.autograd.grad(reference, x, cotangent)
    torch.testing.assert_close(ours_grad, reference_grad)
