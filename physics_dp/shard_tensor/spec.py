"""``ShardTensorSpec``: how a global tensor is split over a device mesh, uneven splits included.

DTensor assumes the ``torch.chunk`` layout (6 rows on 4 ranks -> 2,2,2,0).  Grids in physics
rarely divide evenly and users choose their own splits, so the spec records the extent of the
sharded dim on every coordinate of each mesh axis, and every op carries those sizes through.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import ClassVar, TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh

from .placements import Placement, Replicate, Shard, StridedShard, normalize_placements

__all__ = [
    "ShardTensorSpec",
    "balanced_sizes",
    "chunk_sizes",
    "contiguous_strides",
    "memory_order",
    "in_memory_order",
    "inverse_order",
    "dense_order",
    "strides_in_order",
    "in_spec_order",
    "laid_out_as",
    "CHANNELS_LAST_ORDERS",
    "channels_last_order",
]

_Derived = TypeVar("_Derived")
_DERIVED_LIMIT = 64  # values a spec keeps (see ShardTensorSpec.derived)


def balanced_sizes(extent: int, parts: int) -> tuple[int, ...]:
    """The default split: sizes differ by at most one, larger first (``torch.tensor_split``)."""
    base, extra = divmod(extent, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def chunk_sizes(extent: int, parts: int) -> tuple[int, ...]:
    """The ``torch.chunk`` split DTensor assumes (trailing ranks may be empty)."""
    step = -(-extent // parts) if extent else 0
    return tuple(max(0, min(step, extent - i * step)) for i in range(parts))


def memory_order(stride: Sequence[int]) -> list[int]:
    """The dims of a layout with ``stride`` from outermost to innermost in memory."""
    return sorted(range(len(stride)), key=lambda d: -stride[d])


def in_memory_order(local: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``local`` with its dims laid out in memory from outermost to innermost as ``order``: a slab
    that keeps its global tensor's memory order (a copy only where it is not already so)."""
    return local.permute(order).contiguous().permute(inverse_order(order))


def inverse_order(order: Sequence[int]) -> list[int]:
    """The permutation that undoes ``permute(order)``."""
    return sorted(range(len(order)), key=order.__getitem__)


# channels last (torch.channels_last, channels_last_3d): the channel dim innermost, by tensor rank
CHANNELS_LAST_ORDERS = {4: (0, 2, 3, 1), 5: (0, 2, 3, 4, 1)}
_CHANNELS_LAST_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def channels_last_order(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The memory order of a channels-last tensor, else None: torch's ``suggest_memory_format``,
    for which a tensor that is also row-major (one channel, one pixel) is row-major."""
    memory_format = _CHANNELS_LAST_FORMATS.get(tensor.ndim)
    if memory_format is None or not tensor.is_contiguous(memory_format=memory_format) or tensor.is_contiguous():
        return None
    return CHANNELS_LAST_ORDERS[tensor.ndim]


def dense_order(shape: Sequence[int], stride: Sequence[int]) -> list[int] | None:
    """The dims from outermost to innermost where ``stride`` is a permutation of a dense row-major
    layout of ``shape`` (a transpose, a permute, channels last), else None (an overlapping or
    gapped layout)."""
    order = memory_order(stride)
    expected = 1
    for dim in reversed(order):
        if shape[dim] != 1 and stride[dim] != expected:
            return None
        expected *= shape[dim]
    return order


def _dense_in(shape: Sequence[int], stride: Sequence[int], order: Sequence[int]) -> bool:
    """Whether ``stride`` lays ``shape`` out densely with its dims in ``order``, ignoring the strides
    of size-1 dims (torch's ``is_contiguous(memory_format=...)``)."""
    expected = 1
    for dim in reversed(list(order)):
        if shape[dim] != 1:
            if stride[dim] != expected:
                return False
            expected *= shape[dim]
    return True


def strides_in_order(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """The strides of a dense layout of ``shape`` whose dims lie in memory from outermost to
    innermost as ``order`` (row-major for ``range(len(shape))``)."""
    strides = [0] * len(shape)
    running = 1
    for dim in reversed(order):
        strides[dim] = running
        running *= max(shape[dim], 1)
    return tuple(strides)


def in_spec_order(local: torch.Tensor, spec: ShardTensorSpec) -> torch.Tensor:
    """``local`` laid out in memory as ``spec``'s global strides say: row-major for a contiguous
    spec, the same permutation of dims for a dense permuted one (channels last), a copy only where
    it is not already so.  Why: a spec's strides must describe its slab on every rank, and a
    kernel's output layout may depend on a slab's own extents (0 or 1 rows)."""
    if spec.is_contiguous():
        return local.contiguous()
    order = dense_order(spec.shape, spec.stride)
    return local.contiguous() if order is None else in_memory_order(local, order)


def laid_out_as(local: torch.Tensor, spec: ShardTensorSpec) -> bool:
    """Whether ``local`` already lies in memory as ``spec``'s dense layout says (what
    :func:`in_spec_order` would not copy)."""
    if spec.is_contiguous():
        return local.is_contiguous()
    order = dense_order(spec.shape, spec.stride)
    return order is not None and local.permute(order).is_contiguous()


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    running = 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


_coordinate_cache: dict[int, tuple[DeviceMesh, tuple[int, ...]]] = {}


def mesh_coordinate(mesh: DeviceMesh) -> tuple[int, ...]:
    """This rank's coordinate in ``mesh`` (cached: it is asked for on every op)."""
    cached = _coordinate_cache.get(id(mesh))
    if cached is not None and cached[0] is mesh:
        return cached[1]
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError("this rank is not part of the device mesh the ShardTensor lives on")
    _coordinate_cache[id(mesh)] = (mesh, tuple(coordinate))
    return tuple(coordinate)


class ShardTensorSpec:
    """Mesh, placements, global shape, and the per-coordinate extents of each sharded dim.

    ``axis_sizes[a]`` is, for a mesh axis ``a`` carrying ``Shard(d)``, the extent of dim ``d``
    on each coordinate of that axis (``None`` for Replicate/Partial axes).  Specs are
    immutable so ops may share them between inputs and outputs without copies.
    """

    __slots__ = (
        "mesh", "placements", "shape", "stride", "axis_sizes", "has_partial", "local_only", "strided", "_local_shape",
        "_hash", "_contiguous", "_derived",
    )
    # A Shard on a size-1 mesh axis holds the whole dim, so ops run the plain op on the slab.  Off only
    # where tests run the sharded code on one rank (``physics_dp.testing.sharded_code_on_size_one_axes``).
    size_one_shortcut: ClassVar[bool] = True

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        shape: Sequence[int],
        axis_sizes: Sequence[Sequence[int] | None] | None = None,
        stride: Sequence[int] | None = None,
    ) -> None:
        self.mesh = mesh
        self.shape = torch.Size(shape)
        # The global stride mirrors the slab's memory layout (a permuted slab has a permuted
        # stride), so composite ops choose view vs. reshape correctly for the slab.
        self.stride = tuple(stride) if stride is not None else contiguous_strides(self.shape)
        self.placements = normalize_placements(placements, len(self.shape), mesh.ndim)
        given = list(axis_sizes) if axis_sizes is not None else [None] * mesh.ndim
        if len(given) != mesh.ndim:
            raise ValueError(f"axis_sizes has {len(given)} entries for a {mesh.ndim}-D mesh")
        sizes: list[tuple[int, ...] | None] = []
        for axis, placement in enumerate(self.placements):
            if type(placement) is Shard:
                extent = self.shape[placement.dim]
                parts = mesh.size(axis)
                axis_given = given[axis]
                chosen = tuple(int(s) for s in axis_given) if axis_given is not None else balanced_sizes(extent, parts)
                if len(chosen) != parts or sum(chosen) != extent or min(chosen) < 0:
                    raise ValueError(
                        f"sizes {chosen} along mesh axis {axis} do not split dim {placement.dim} of extent "
                        f"{extent} over {parts} ranks: give {parts} non-negative sizes summing to {extent}"
                    )
                sizes.append(chosen)
            elif type(placement) is StridedShard:
                sizes.append(self._strided_sizes(axis, placement, given[axis]))
            else:
                sizes.append(None)
        self.axis_sizes: tuple[tuple[int, ...] | None, ...] = tuple(sizes)
        self._derive()

    def _derive(self) -> None:
        """The fields that follow from the others (the last three computed on first use)."""
        self.has_partial = any(p.is_partial() for p in self.placements)
        # every slab holds the global value: ops need no communication (see local_only.py)
        self.local_only = all(
            type(p) is Replicate or (self.size_one_shortcut and self.mesh.size(a) == 1) for a, p in enumerate(self.placements)
        )
        self.strided = any(type(p) is StridedShard for p in self.placements)
        self._local_shape: torch.Size | None = None
        self._hash: int | None = None
        self._contiguous: bool | None = None
        self._derived: dict | None = None

    @classmethod
    def from_checked(
        cls,
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        shape: torch.Size,
        axis_sizes: tuple[tuple[int, ...] | None, ...],
        stride: tuple[int, ...],
    ) -> ShardTensorSpec:
        """A spec from fields that a spec built on a mesh of this shape already checked (a cached
        plan's output): ``__init__``'s normalization and checks cost more than a small op."""
        spec = cls.__new__(cls)
        spec.mesh, spec.placements, spec.shape, spec.axis_sizes, spec.stride = mesh, placements, shape, axis_sizes, stride
        spec._derive()
        return spec

    def _strided_sizes(self, axis: int, placement: StridedShard, given: Sequence[int] | None) -> tuple[int, ...]:
        if math.prod(placement.factors) != self.shape[placement.dim]:
            raise ValueError(
                f"{placement} on mesh axis {axis}: the factors multiply to {math.prod(placement.factors)}, "
                f"not to the extent {self.shape[placement.dim]} of dim {placement.dim}"
            )
        extent = placement.factors[placement.factor]
        parts = self.mesh.size(axis)
        chosen = tuple(int(s) for s in given) if given is not None else balanced_sizes(extent, parts)
        if len(chosen) != parts or sum(chosen) != extent or min(chosen) < 0:
            raise ValueError(
                f"sizes {chosen} along mesh axis {axis} do not split factor {placement.factor} (extent {extent}) "
                f"of {placement} over {parts} ranks"
            )
        return chosen

    def __reduce__(self) -> tuple:
        """Pickle the defining fields only; unpickling runs ``__init__``, which derives the rest.

        torch.compile's on-disk caches pickle specs: a spec pickled by an older physics_dp must not
        come back without the fields a newer one derives.
        """
        return (ShardTensorSpec, (self.mesh, self.placements, self.shape, self.axis_sizes, self.stride))

    # ----- queries -----------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def shard_dim(self, axis: int) -> int | None:
        placement = self.placements[axis]
        return placement.dim if type(placement) is Shard else None  # type: ignore[attr-defined]

    def sharded_axes(self) -> list[int]:
        return [a for a, p in enumerate(self.placements) if type(p) is Shard]

    def coordinate(self) -> tuple[int, ...]:
        return mesh_coordinate(self.mesh)

    def is_contiguous(self) -> bool:
        """Whether the global layout is the row-major one of the shape (what a fresh slab has)."""
        if self._contiguous is None:
            self._contiguous = self.stride == contiguous_strides(self.shape)
        return self._contiguous

    def derived(self, key: Hashable, build: Callable[[], _Derived]) -> _Derived:
        """``build()``, made once per spec and ``key``, for what depends on this layout alone (a
        view's output spec).  Tensors of one layout share its spec (a pointwise result keeps its
        input's, so does a norm's output), so their ops plan once, not per call.  It lives as long
        as the spec, whose mesh it may hold; at most ``_DERIVED_LIMIT`` keys, so a long-lived
        tensor viewed in ever new shapes does not grow it without bound."""
        if self._derived is None:
            self._derived = {}
        value = self._derived.get(key)
        if value is None:
            if len(self._derived) >= _DERIVED_LIMIT:
                self._derived.clear()
            value = self._derived[key] = build()
        return value

    def is_channels_last(self) -> bool:
        """Whether the layout is channels last and not also row-major, as torch asks it
        (``suggest_memory_format``; strides of size-1 dims do not count, so a layout with one
        channel or one pixel is row-major)."""
        order = CHANNELS_LAST_ORDERS.get(self.ndim)
        if order is None or self.is_contiguous():
            return False
        return self.derived(
            ("channels last",),
            lambda: _dense_in(self.shape, self.stride, order) and not _dense_in(self.shape, self.stride, range(self.ndim)),
        )

    def in_order(self, order: Sequence[int]) -> ShardTensorSpec:
        """This spec laid out densely with its dims in memory from outermost to innermost as
        ``order`` (built once per spec and order)."""
        order = tuple(order)
        if list(order) == list(range(self.ndim)):
            return self.replace()
        return self.derived(
            ("order", order),
            lambda: ShardTensorSpec(self.mesh, self.placements, self.shape, self.axis_sizes, strides_in_order(self.shape, order)),
        )

    def local_shape(self, coordinate: Sequence[int] | None = None) -> torch.Size:
        """The local slab's shape at ``coordinate`` (this rank's by default)."""
        if coordinate is None:
            if self._local_shape is None:
                self._local_shape = self._shape_at(self.coordinate())
            return self._local_shape
        return self._shape_at(coordinate)

    def _shape_at(self, coordinate: Sequence[int]) -> torch.Size:
        shape = list(self.shape)
        for axis, sizes in enumerate(self.axis_sizes):
            if sizes is not None and type(self.placements[axis]) is Shard:
                shape[self.placements[axis].dim] = sizes[coordinate[axis]]  # type: ignore[attr-defined]
        if self.strided:
            for dim, extents in self.local_factors(coordinate).items():
                shape[dim] = math.prod(extents)
        return torch.Size(shape)

    def local_factors(self, coordinate: Sequence[int] | None = None) -> dict[int, list[int]]:
        """For each strided dim, the local extent of every factor at ``coordinate`` (row-major)."""
        coordinate = self.coordinate() if coordinate is None else coordinate
        result: dict[int, list[int]] = {}
        for axis, placement in enumerate(self.placements):
            if type(placement) is StridedShard:
                extents = result.setdefault(placement.dim, list(placement.factors))
                extents[placement.factor] = self.axis_sizes[axis][coordinate[axis]]  # type: ignore[index]
        return result

    def factor_offsets(self, coordinate: Sequence[int] | None = None) -> dict[int, list[int]]:
        """For each strided dim, the global index of the slab's first element in every factor."""
        coordinate = self.coordinate() if coordinate is None else coordinate
        result: dict[int, list[int]] = {}
        for axis, placement in enumerate(self.placements):
            if type(placement) is StridedShard:
                starts = result.setdefault(placement.dim, [0] * len(placement.factors))
                starts[placement.factor] = sum(self.axis_sizes[axis][: coordinate[axis]])  # type: ignore[index]
        return result

    def offsets(self, coordinate: Sequence[int] | None = None) -> tuple[int, ...]:
        """Global index of the local slab's first element along every tensor dim.

        A strided dim has no such index (its slab is not a contiguous range): see
        :meth:`factor_offsets`.
        """
        if self.strided:
            raise RuntimeError(f"{self} has strided dims, whose slabs are no contiguous range: use factor_offsets")
        coordinate = self.coordinate() if coordinate is None else coordinate
        offsets = [0] * self.ndim
        for axis, sizes in enumerate(self.axis_sizes):
            if sizes is not None:
                offsets[self.placements[axis].dim] = sum(sizes[: coordinate[axis]])  # type: ignore[attr-defined]
        return tuple(offsets)

    def sharding_shapes(self) -> dict[int, tuple[torch.Size, ...]]:
        """For each sharded mesh axis, the local shapes of the ranks along it (this rank's group)."""
        mine = list(self.coordinate())
        result: dict[int, tuple[torch.Size, ...]] = {}
        for axis in self.sharded_axes():
            shapes = []
            for c in range(self.mesh.size(axis)):
                coordinate = list(mine)
                coordinate[axis] = c
                shapes.append(self._shape_at(coordinate))
            result[axis] = tuple(shapes)
        return result

    def is_chunk_layout(self) -> bool:
        """Whether every sharded dim uses DTensor's ``torch.chunk`` layout."""
        return not self.strided and all(
            sizes is None or sizes == chunk_sizes(sum(sizes), len(sizes)) for sizes in self.axis_sizes
        )

    # ----- derived specs -----------------------------------------------------------------
    def replace(
        self,
        *,
        placements: Sequence[Placement] | None = None,
        shape: Sequence[int] | None = None,
        axis_sizes: Sequence[Sequence[int] | None] | None = None,
    ) -> ShardTensorSpec:
        """A spec for a freshly laid out (contiguous) slab with some fields changed."""
        if placements is None and shape is None and axis_sizes is None and self.is_contiguous():
            return self  # specs are immutable: a contiguous one is its own contiguous layout
        return ShardTensorSpec(
            self.mesh,
            self.placements if placements is None else placements,
            self.shape if shape is None else shape,
            self.axis_sizes if axis_sizes is None and placements is None else axis_sizes,
        )

    # ----- identity ----------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, ShardTensorSpec):
            return NotImplemented
        return (
            self.shape == other.shape
            and self.stride == other.stride
            and self.placements == other.placements
            and self.axis_sizes == other.axis_sizes
            and (self.mesh is other.mesh or self.mesh == other.mesh)
        )

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((id(self.mesh), self.placements, tuple(self.shape), self.stride, self.axis_sizes))
        return self._hash

    def __repr__(self) -> str:
        names = self.mesh.mesh_dim_names or tuple(range(self.mesh.ndim))
        axes = ", ".join(
            f"{name}:{placement}" + (f"{list(sizes)}" if sizes is not None else "")
            for name, placement, sizes in zip(names, self.placements, self.axis_sizes)
        )
        return f"ShardTensorSpec(shape={tuple(self.shape)}, {axes})"
