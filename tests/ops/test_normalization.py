"""Sharded group, batch, instance and layer norm equal one device, forward, backward and running stats.

Layouts: 1-4 ranks sharding H; a 2x2 mesh sharding H over one axis and W over the other; a
("data", "domain") 2x2 mesh sharding the batch and H.  Splits: even, uneven (13 rows, 7
columns, 3 samples) and skewed explicit sizes with an empty shard.  One rank-function call runs
every split and variant of a family on a layout; a failure names the combination.  The layout
helpers here are shared with ``test_reductions.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from physics_dp.distributed.collectives import count_communication
from physics_dp.ops import fused_cpu
from physics_dp.ops._local import ShardedOpError
from physics_dp.shard_tensor import Partial, Replicate, Shard, ShardTensor, distribute_tensor
from physics_dp.testing import get_mesh, run_on_ranks
from physics_dp.testing.compare import assert_sharded_matches

from .test_shape_ops import run_combos, skewed_sizes

# name -> (mesh shape, mesh axis names, tensor dim sharded by each mesh axis)
LAYOUTS = {
    "1": ((1,), ("domain",), (2,)),
    "2": ((2,), ("domain",), (2,)),
    "3": ((3,), ("domain",), (2,)),
    "4": ((4,), ("domain",), (2,)),
    "2x2-HxW": ((2, 2), ("h", "w"), (2, 3)),
    "2x2-data-domain": ((2, 2), ("data", "domain"), (0, 2)),
}
# (N, C, H, W) per split kind; "skewed" uses explicit sizes with an empty shard
SHAPES = {"even": (4, 4, 12, 8), "uneven": (3, 4, 13, 7), "skewed": (3, 4, 13, 7)}


def world_of(layout: str) -> int:
    shape = LAYOUTS[layout][0]
    return shape[0] * (shape[1] if len(shape) > 1 else 1)


def sharding(layout: str, split: str, shape: tuple[int, ...]):
    """(mesh, placements, sharding sizes or None) for a tensor of ``shape`` on ``layout``."""
    mesh_shape, names, dims = LAYOUTS[layout]
    mesh = get_mesh(mesh_shape, names)
    placements = [Shard(d) for d in dims]
    sizes = None
    if split == "skewed":
        sizes = {axis: skewed_sizes(shape[d], mesh_shape[axis]) for axis, d in enumerate(dims)}
    return mesh, placements, sizes


def randn(shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ----- module checks --------------------------------------------------------------------------------
def _randomize(module: nn.Module, seed: int = 3) -> nn.Module:
    """Non-trivial affine parameters and running statistics, so every gradient and buffer is tested."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in module.parameters():
            tensor.copy_(1 + 0.5 * torch.randn(tensor.shape, generator=generator))
        for name, buffer in module.named_buffers():
            if name.endswith("running_mean"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator))
            elif name.endswith("running_var"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=generator))
    return module


def _check_module(module: nn.Module, x: torch.Tensor, mesh, placements, sizes, warmup_calls: int = 0) -> None:
    """Outputs and all gradients match; running buffers match a reference that saw the same calls."""
    module = _randomize(module)
    reference = copy.deepcopy(module)
    for _ in range(warmup_calls):
        module(distribute_tensor(x, mesh, placements, sizes))
        reference(x)
    assert_sharded_matches(module, [x], mesh, [placements], sharding_sizes=[sizes])
    reference(x)
    expected = dict(reference.named_buffers())
    for name, buffer in module.named_buffers():
        torch.testing.assert_close(buffer, expected[name], atol=1e-5, rtol=1e-5, msg=lambda m: f"buffer {name}: {m}")


def _module_combos(layout: str, split: str, builders: dict[str, Callable[[tuple], tuple | None]]) -> dict[str, Callable]:
    """Each builder maps the 4-D base shape to (module, input shape, warmup calls), or None if not applicable."""
    combos = {}
    for variant, build in builders.items():
        spec = build(SHAPES[split])
        if spec is None:
            continue
        module, shape, warmup = spec

        def check(module=module, shape=shape, warmup=warmup):
            mesh, placements, sizes = sharding(layout, split, shape)
            _check_module(module, randn(shape), mesh, placements, sizes, warmup)

        combos[f"{variant} on {layout} ({split}, shape {shape})"] = check
    return combos


def _three_d(shape: tuple, layout: str) -> tuple | None:
    """(N, C, H): only where no mesh axis shards W."""
    return None if 3 in LAYOUTS[layout][2] else shape[:3]


def _five_d(shape: tuple) -> tuple:
    return (*shape, 2)


def _group_norm_builders(layout: str) -> dict:
    return {
        "GroupNorm(2, 4)": lambda s: (nn.GroupNorm(2, 4), s, 0),
        "GroupNorm(4, 4, affine=False)": lambda s: (nn.GroupNorm(4, 4, affine=False), s, 0),
        "GroupNorm(1, 4, eps=1e-3)": lambda s: (nn.GroupNorm(1, 4, eps=1e-3), s, 0),
        "GroupNorm(2, 4) 5-D": lambda s: (nn.GroupNorm(2, 4), _five_d(s), 0),
        "GroupNorm(2, 4) 3-D": lambda s: _three_d(s, layout) and (nn.GroupNorm(2, 4), _three_d(s, layout), 0),
    }


def _batch_norm_builders(layout: str) -> dict:
    return {
        "BatchNorm2d train": lambda s: (nn.BatchNorm2d(4), s, 0),
        "BatchNorm2d train affine=False momentum=0.3": lambda s: (nn.BatchNorm2d(4, affine=False, momentum=0.3), s, 0),
        "BatchNorm2d momentum=None, 2 calls": lambda s: (nn.BatchNorm2d(4, momentum=None), s, 1),
        "BatchNorm2d no running stats": lambda s: (nn.BatchNorm2d(4, track_running_stats=False), s, 0),
        "BatchNorm2d eval": lambda s: (nn.BatchNorm2d(4).eval(), s, 0),
        "BatchNorm3d train": lambda s: (nn.BatchNorm3d(4), _five_d(s), 0),
        "BatchNorm1d train": lambda s: _three_d(s, layout) and (nn.BatchNorm1d(4), _three_d(s, layout), 0),
    }


def _instance_norm_builders(layout: str) -> dict:
    return {
        "InstanceNorm2d": lambda s: (nn.InstanceNorm2d(4), s, 0),
        "InstanceNorm2d affine, running stats": lambda s: (
            nn.InstanceNorm2d(4, affine=True, track_running_stats=True), s, 0,
        ),
        "InstanceNorm2d eval with running stats": lambda s: (
            nn.InstanceNorm2d(4, affine=True, track_running_stats=True).eval(), s, 0,
        ),
        "InstanceNorm3d affine": lambda s: (nn.InstanceNorm3d(4, affine=True), _five_d(s), 0),
    }


def _layer_norm_builders(layout: str) -> dict:
    return {
        "LayerNorm([C, H, W])": lambda s: (nn.LayerNorm(list(s[1:])), s, 0),
        "LayerNorm([W])": lambda s: (nn.LayerNorm([s[3]]), s, 0),
        "LayerNorm([H, W], no affine)": lambda s: (nn.LayerNorm(list(s[2:]), elementwise_affine=False), s, 0),
        "LayerNorm([H, W], no bias)": lambda s: (nn.LayerNorm(list(s[2:]), bias=False), s, 0),
        "LayerNorm([H, W, 2]) 5-D": lambda s: (nn.LayerNorm([s[2], s[3], 2]), _five_d(s), 0),
    }


# family -> (call with parameters passed as plain inputs, parameter shape from the input shape)
FUNCTIONAL = {
    "group_norm": (lambda x, w, b: F.group_norm(x, 2, w, b, eps=1e-2), lambda shape: shape[1:2]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, x.shape[1:], w, b), lambda shape: shape[1:]),
}


def _functional_combo(layout: str, split: str, family: str) -> dict[str, Callable[[], None]]:
    """F.group_norm / F.layer_norm with the parameters as inputs, so their gradients are compared."""
    fn, param_shape = FUNCTIONAL[family]
    shape = SHAPES[split]
    mesh, placements, sizes = sharding(layout, split, shape)
    inputs = [randn(shape), randn(param_shape(shape), seed=1), randn(param_shape(shape), seed=2)]

    def check() -> None:
        assert_sharded_matches(fn, inputs, mesh, [placements, None, None], sharding_sizes=[sizes, None, None])

    return {f"F.{family} with parameters as inputs on {layout} ({split})": check}


FAMILIES = {
    "group_norm": _group_norm_builders,
    "batch_norm": _batch_norm_builders,
    "instance_norm": _instance_norm_builders,
    "layer_norm": _layer_norm_builders,
}


def _check_family(layout: str, family: str) -> list[str]:
    combos: dict[str, Callable[[], None]] = {}
    for split in SHAPES:
        combos.update(_module_combos(layout, split, FAMILIES[family](layout)))
        if family in FUNCTIONAL:
            combos.update(_functional_combo(layout, split, family))
    return run_combos(combos)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_normalization_matches_single_device(layout: str, family: str) -> None:
    checked = run_on_ranks(world_of(layout), _check_family, layout, family)[0]
    assert len(checked) >= 3 * 4, checked


def on_stock_kernels(check: Callable[..., Any], *args) -> Any:
    """``check`` with the fused CPU kernels off: the path of a GPU, or of a CPU rank without a compiler."""
    previous = fused_cpu.set_enabled(False)
    try:
        return check(*args)
    finally:
        fused_cpu.set_enabled(previous)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", ["3", "2x2-HxW"])
def test_stock_cpu_kernels_match_single_device(layout: str, family: str) -> None:
    checked = run_on_ranks(world_of(layout), on_stock_kernels, _check_family, layout, family)[0]
    assert len(checked) >= 3 * 4, checked


# ----- communication --------------------------------------------------------------------------------
def _group_norm_traffic(layout: str) -> list[dict[str, list[tuple[str, int]]]]:
    """Collectives (kind, bytes) of GroupNorm forward and backward at a small and a large grid."""
    traffic = []
    for shape in ((2, 4, 13, 7), (2, 4, 61, 37)):
        mesh, placements, _ = sharding(layout, "uneven", shape)
        x = distribute_tensor(randn(shape), mesh, placements).requires_grad_(True)
        module = nn.GroupNorm(2, 4)
        with count_communication() as forward:
            y = module(x)
        split = {axis: sizes for axis, sizes in enumerate(y._spec.axis_sizes) if sizes}
        cotangent = distribute_tensor(randn(shape, seed=9), mesh, y.placements, split)
        with count_communication() as backward:
            y.backward(cotangent)
        traffic.append({
            "forward": [(r.kind, r.bytes_sent) for r in forward.records],
            "backward": sorted((r.kind, r.bytes_sent) for r in backward.records),
        })
    return traffic


@pytest.mark.parametrize("layout", ["2", "4", "2x2-HxW", "2x2-data-domain"])
def test_group_norm_communication_does_not_grow_with_the_grid(layout: str) -> None:
    small, large = run_on_ranks(world_of(layout), _group_norm_traffic, layout)[0]
    assert small == large
    # forward: one all-gather of (count, mean, variance) over the ranks splitting H (and W); backward:
    # one all-reduce of the per-(sample, channel) sums of dy and dy * x, from which the weight and
    # bias gradients follow already summed over those ranks (whole-mesh axes reduce in one
    # collective over the job).  A split batch still sums the weight and bias grads over it (one
    # bucket at the end of backward).
    batch_split = layout == "2x2-data-domain"
    samples_here = 1 if batch_split else 2
    stat_ranks = 2 if layout in ("2", "2x2-data-domain") else 4
    # float64 count, then a mean and a variance per (sample, group): 2 samples x 2 groups
    assert small["forward"] == [("all_gather", (1 + 2 * samples_here * 2) * 8 * (stat_ranks - 1))]
    assert [kind for kind, _ in small["backward"]] == ["all_reduce"] * (2 if batch_split else 1)
    assert (2 * samples_here * 4 * 8) in [size for _, size in small["backward"]]  # float64 sums of dy, dy * x


def _no_forward_communication() -> list[str]:
    mesh, placements, sizes = sharding("2", "uneven", SHAPES["uneven"])
    x = distribute_tensor(randn(SHAPES["uneven"]), mesh, placements, sizes)
    modules = {
        "LayerNorm over unsharded trailing W": nn.LayerNorm([SHAPES["uneven"][3]]),
        "BatchNorm2d eval": _randomize(nn.BatchNorm2d(4)).eval(),
        "InstanceNorm2d eval with running stats": _randomize(nn.InstanceNorm2d(4, track_running_stats=True)).eval(),
    }
    for name, module in modules.items():
        with count_communication() as log:
            module(x)
        assert log.calls == 0, f"{name}: {log.kinds()}"
    return list(modules)


def test_unsharded_or_eval_normalization_needs_no_communication() -> None:
    run_on_ranks(2, _no_forward_communication)


def _batch_only() -> list[str]:
    """Only the batch split (one sample on one rank, none on another): per-sample norms stay local,
    batch statistics and instance norm's running averages span the ranks."""
    mesh = get_mesh((3,))
    shape = SHAPES["uneven"]
    x = randn(shape)
    combos = {}
    for name, module, forward_calls in (
        ("GroupNorm(2, 4)", nn.GroupNorm(2, 4), 0),
        ("LayerNorm([C, H, W])", nn.LayerNorm(list(shape[1:])), 0),
        ("BatchNorm2d train", nn.BatchNorm2d(4), 1),
        ("InstanceNorm2d running stats", nn.InstanceNorm2d(4, track_running_stats=True), 2),
    ):

        def check(module=module, calls=forward_calls) -> None:
            with count_communication() as log:
                module(distribute_tensor(x, mesh, [Shard(0)], {0: [1, 0, 2]}))
            assert log.calls == calls, log.kinds()
            _check_module(module, x, mesh, [Shard(0)], {0: [1, 0, 2]})

        combos[f"{name} with the batch split 1, 0, 2"] = check
    return run_combos(combos)


def test_batch_only_sharding() -> None:
    run_on_ranks(3, _batch_only)


class _OnChannelSlice(nn.Module):
    """``norm`` of channels 2: of its input: a strided slab (N > 1), whose (N, C, L) view is not contiguous."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x[:, 2:])


def _channel_slices() -> list[str]:
    shape = (3, 6, 13, 7)
    combos = {}
    for name, norm in (
        ("GroupNorm(2, 4)", nn.GroupNorm(2, 4)),
        ("BatchNorm2d(4)", nn.BatchNorm2d(4)),
        ("InstanceNorm2d(4, affine)", nn.InstanceNorm2d(4, affine=True)),
        ("LayerNorm([4, 13, 7])", nn.LayerNorm([4, 13, 7])),
        ("LayerNorm([4, 13, 7], no affine)", nn.LayerNorm([4, 13, 7], elementwise_affine=False)),
    ):

        def check(norm=norm) -> None:
            mesh, placements, _ = sharding("2", "uneven", shape)
            _check_module(_OnChannelSlice(norm), randn(shape), mesh, placements, None)

        combos[f"{name} of a channel slice"] = check
    return run_combos(combos)


def test_normalization_of_a_strided_slab() -> None:
    run_on_ranks(2, _channel_slices)


def _output_nodes() -> dict[str, list[str]]:
    """The autograd nodes from each sharded norm's output back to its input, a leaf."""
    x = distribute_tensor(randn((2, 4, 12, 8)), get_mesh((2,)), [Shard(2)]).requires_grad_(True)
    weight, bias = randn((4, 12, 8), seed=1).requires_grad_(True), randn((4, 12, 8), seed=2).requires_grad_(True)
    norms = {
        "group": lambda t: F.group_norm(t, 2),
        "batch": lambda t: F.batch_norm(t, None, None, training=True),
        "instance": lambda t: F.instance_norm(t),
        "layer, no affine": lambda t: F.layer_norm(t, t.shape[1:]),
        "layer, affine (on the fused CPU kernels)": lambda t: F.layer_norm(t, t.shape[1:], weight, bias),
    }
    nodes = {}
    for name, norm in norms.items():
        y = norm(x)
        assert isinstance(y, ShardTensor)
        node, chain = y.grad_fn, []
        while node.name() != "torch::autograd::AccumulateGrad":
            chain.append(node.name())
            node = node.next_functions[0][0]
        nodes[name] = chain
    return nodes


def test_a_sharded_norm_is_one_autograd_node() -> None:
    """The norm's Function returns the ShardTensor itself: no conversion node between it and its
    output (one cost tens of microseconds each way with the caches cold after the norm's kernels),
    and layer norm's affine runs inside it, in its kernels' passes.  Layer norm's Function takes the
    ShardTensor itself too: no conversion node before it either."""
    for nodes in run_on_ranks(2, _output_nodes):
        for name, chain in nodes.items():
            # the channel norms take the slab, viewed as (N, C, L)
            expected = ["_NormalizeGloballyBackward"] if name.startswith("layer") else ["_ChannelNormBackward", "ViewBackward0", "_ToLocalBackward"]
            assert chain == expected, (name, chain)


# ----- numerics, precision, errors ------------------------------------------------------------------
def _large_offset_combos(memory_format: torch.memory_format) -> dict[str, Callable[[], None]]:
    """1e8 + N(0, 1) in float64: E[x^2] - E[x]^2 loses every digit of the variance; merged M2 does not."""
    shape = SHAPES["uneven"]
    mesh, placements, sizes = sharding("3", "skewed", shape)
    x = (1e8 + randn(shape, dtype=torch.float64)).contiguous(memory_format=memory_format)
    naive = (x * x).mean() - x.mean() ** 2
    assert abs(float(naive) - float(x.var(correction=0))) > 0.1, "the offset is too small to defeat the naive formula"
    modules = {
        "GroupNorm": nn.GroupNorm(2, 4).double(),
        "BatchNorm2d": nn.BatchNorm2d(4).double(),
        "InstanceNorm2d": nn.InstanceNorm2d(4, track_running_stats=True).double(),
        "LayerNorm": nn.LayerNorm(list(shape[1:])).double(),
    }
    return {
        f"{name} on 1e8 + N(0, 1)": (lambda m=m: _check_module(_RowMajorOnOneDevice(m), x, mesh, placements, sizes))
        for name, m in modules.items()
    }


class _RowMajorOnOneDevice(nn.Module):
    """``module`` on a ShardTensor as given, and on a plain tensor made row-major first: torch's own
    channels-last group norm on the CPU computes E[x^2] - E[x]^2 (off by about 1e3 at a 1e8 offset in
    float64) and its input gradient of a constant grid is off by 8e-5 of its size (row-major: 7e-8),
    so the one-device reference of a channels-last input runs row-major."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x if isinstance(x, ShardTensor) else x.contiguous())


def _constant_slab_combos(memory_format: torch.memory_format) -> dict[str, Callable[[], None]]:
    """Rows constant on a rank (their local 1 / std is inf), and a grid constant everywhere."""
    shape = SHAPES["uneven"]
    mesh, placements, _ = sharding("3", "uneven", shape)
    first_rows = (shape[2] + 2) // 3  # the first rank's rows of the balanced split
    partly = randn(shape)
    partly[:, :, : first_rows + 1] = 0.25  # the first rank's slab and the next rank's first row
    everywhere = torch.full(shape, 0.25)
    combos = {}
    for label, x in (("constant first slab", partly), ("constant grid", everywhere)):
        x = x.contiguous(memory_format=memory_format)
        for name, module in (
            ("GroupNorm", nn.GroupNorm(2, 4)),
            ("BatchNorm2d", nn.BatchNorm2d(4)),
            ("InstanceNorm2d", nn.InstanceNorm2d(4, affine=True)),
            ("LayerNorm", nn.LayerNorm(list(shape[1:]))),
        ):
            combos[f"{name} on a {label}"] = lambda m=module, x=x: _check_module(_RowMajorOnOneDevice(m), x, mesh, placements, None)
    return combos


def _bfloat16_check(memory_format: torch.memory_format) -> None:
    shape = SHAPES["uneven"]
    mesh, placements, sizes = sharding("3", "skewed", shape)
    x = randn(shape).bfloat16().contiguous(memory_format=memory_format)
    module = nn.GroupNorm(2, 4).bfloat16()
    assert_sharded_matches(module, [x], mesh, [placements], sharding_sizes=[sizes], atol=3e-2, rtol=3e-2)


def _numerics(memory_format: torch.memory_format) -> list[str]:
    return run_combos({
        **_large_offset_combos(memory_format), **_constant_slab_combos(memory_format),
        "GroupNorm bfloat16": lambda: _bfloat16_check(memory_format),
    })


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["row-major", "channels last"])
def test_large_offset_and_low_precision(memory_format: torch.memory_format) -> None:
    run_on_ranks(3, _numerics, memory_format)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["row-major", "channels last"])
def test_large_offset_and_low_precision_on_stock_cpu_kernels(memory_format: torch.memory_format) -> None:
    run_on_ranks(3, on_stock_kernels, _numerics, memory_format)


def _unsupported() -> list[str]:
    mesh = get_mesh((2,))
    x = distribute_tensor(randn((2, 4, 6, 5)), mesh, [Shard(1)])
    messages = []
    for name, call in {
        "group_norm": lambda: F.group_norm(x, 2),
        "batch_norm": lambda: F.batch_norm(x, None, None, training=True),
        "instance_norm": lambda: F.instance_norm(x),
    }.items():
        with pytest.raises(ShardedOpError) as info:
            call()
        message = str(info.value)
        assert name in message and "Shard(dim=1)" in message and "channel dim 1 is sharded" in message, message
        messages.append(message)
    return messages


def test_sharded_channel_dim_raises_naming_op_placements_and_reason() -> None:
    run_on_ranks(2, _unsupported)


def _partial_input() -> bool:
    """A pending sum is resolved before normalizing (normalization is not linear)."""
    mesh = get_mesh((2,))
    x = randn((2, 4, 6, 5))
    xs = ShardTensor.from_local(x / 2, mesh, [Partial("sum")])
    y = F.group_norm(xs, 2)
    assert y.placements == (Replicate(),)
    torch.testing.assert_close(y.full_tensor(), F.group_norm(x, 2))
    return True


def test_partial_input_is_reduced_first() -> None:
    run_on_ranks(2, _partial_input)


def _forced_cutting(parts: int) -> tuple[Callable[..., int], list[bool]]:
    """A stand-in for ``normalization.row_parts`` that cuts every row ``parts`` divides (as a GPU
    cuts long rows), and the list of its answers (True where it cut)."""
    cuts: list[bool] = []

    def cut(rows: int, length: int, device: torch.device, batch: int = 1) -> int:
        cuts.append(length % parts == 0)
        return parts if cuts[-1] else 1

    return cut, cuts


def _families_with_rows_cut() -> tuple[list[str], int]:
    """Each family's first module on 2 ranks with every even row forced into 2 parts, against one
    device; and how many rows were cut."""
    from physics_dp.ops import normalization as N

    real = N.row_parts
    N.row_parts, cuts = _forced_cutting(2)
    try:
        combos: dict[str, Callable[[], None]] = {}
        for builders in FAMILIES.values():
            name, build = next(iter(builders("2").items()))
            combos.update(_module_combos("2", "even", {name: build}))
        return run_combos(combos), sum(cuts)
    finally:
        N.row_parts = real


def test_rows_cut_into_parts_match_single_device_across_ranks() -> None:
    # rows are cut for GPUs, which run the stock kernels
    for _, cut in run_on_ranks(2, on_stock_kernels, _families_with_rows_cut):
        assert cut > 0


def local_norm(kind: str, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, groups: int = 4) -> torch.Tensor:
    """The autograd functions behind the sharded norms over no process group (the slab's own
    statistics); shared with ``test_normalization_cuda.py``.  A channels-last ``x`` of group or
    batch norm is taken as the (N, L, C) view of its memory, as the sharded norms take it."""
    from physics_dp.ops import normalization as N

    n, c = x.shape[:2]
    if kind in ("group", "batch") and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        tokens = x.permute(0, 2, 3, 1).reshape(n, -1, c)  # a view: channels innermost
        layout = N._StatLayout(groups, True, channels_last=True) if kind == "group" else N._StatLayout(c, False, channels_last=True)
        y = N._ChannelNorm.apply(tokens, weight, bias, layout, (), 1e-5)[0]
        return y.view(n, *x.shape[2:], c).permute(0, 3, 1, 2)
    if kind == "layer":
        return N._NormalizeGlobally.apply(x, tuple(range(1, x.ndim)), (), 1e-5)
    layout = {"group": N._StatLayout(groups, True), "batch": N._StatLayout(c, False), "instance": N._StatLayout(c, True)}[kind]
    return N._ChannelNorm.apply(x.reshape(n, c, -1), weight, bias, layout, (), 1e-5)[0].view(x.shape)


def torch_norm(kind: str, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, groups: int = 4) -> torch.Tensor:
    """torch's own op for :func:`local_norm` (layer norm without affine parameters)."""
    if kind == "group":
        return F.group_norm(x, groups, weight, bias)
    if kind == "batch":
        return F.batch_norm(x, None, None, weight, bias, training=True)
    if kind == "instance":
        return F.instance_norm(x, weight=weight, bias=bias)
    return F.layer_norm(x, x.shape[1:])


@pytest.mark.parametrize("kernels", ["fused CPU", "stock"])
@pytest.mark.parametrize("kind", ["group", "batch"])
def test_channels_last_local_norm_equals_torch(kind: str, kernels: str) -> None:
    """The norm Function on the (N, L, C) view of a channels-last slab, with constant channels and a
    constant sample, against torch's op on the row-major tensor; the output is channels last."""
    generator = torch.Generator().manual_seed(0)
    x = 3 + torch.randn(2, 8, 5, 7, generator=generator, dtype=torch.float64)
    x[0, 1], x[1] = 0.5, 0.25
    weight, bias = (torch.randn(8, generator=generator, dtype=torch.float64).requires_grad_() for _ in range(2))
    cotangent = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    results = []
    previous = fused_cpu.set_enabled(kernels == "fused CPU")
    try:
        for op, data in ((local_norm, x.contiguous(memory_format=torch.channels_last)), (torch_norm, x)):
            data = data.clone().requires_grad_()
            out = op(kind, data, weight, bias)
            results.append((out, *torch.autograd.grad(out, (data, weight, bias), cotangent)))
    finally:
        fused_cpu.set_enabled(previous)
    assert results[0][0].is_contiguous(memory_format=torch.channels_last)
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("kind", ["group", "batch", "instance", "layer"])
@pytest.mark.parametrize("parts", [2, 3])
def test_rows_cut_into_parts_give_the_same_norm(kind: str, parts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the backward's row sums and the rescale cut a few long rows into parts; forced on the CPU, they match torch."""
    from physics_dp.ops import normalization as N

    cut, cuts = _forced_cutting(parts)
    monkeypatch.setattr(N, "row_parts", cut)
    monkeypatch.setattr(fused_cpu, "_enabled", False)  # GPUs, which cut rows, run the stock kernels
    generator = torch.Generator().manual_seed(parts)
    shape = (2, 4, 6, 5)  # every row length (30, 60, 120) divides by 2 and 3
    x = (3 + torch.randn(shape, generator=generator, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(4, generator=generator, dtype=torch.float64).requires_grad_()
    bias = torch.randn(4, generator=generator, dtype=torch.float64).requires_grad_()
    cotangent = torch.randn(shape, generator=generator, dtype=torch.float64)
    inputs = [x] if kind == "layer" else [x, weight, bias]
    results = []
    for op in (local_norm, torch_norm):
        out = op(kind, x, weight, bias, groups=2)
        results.append((out, *torch.autograd.grad(out, inputs, cotangent)))
    assert any(cuts), "the norm cut no row into parts"
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
