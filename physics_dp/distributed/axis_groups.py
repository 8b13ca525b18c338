"""One process group over several mesh axes (the ranks that share every other coordinate).

Tokens of a 2-D decomposition are split over two mesh axes at once; ring attention over them
needs a single ring through every rank holding a share.  DeviceMesh hands out one group per
axis; flattening axes into one group is private API there, so the groups are built here with
``dist.new_group`` (collectively, by every rank, once per mesh and set of axes).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["group_over_axes"]

Members = list[tuple[int, ...]]
_cache: dict[tuple[int, tuple[int, ...]], tuple[DeviceMesh, ProcessGroup, Members]] = {}


def _rank_at(mesh: DeviceMesh) -> dict[tuple[int, ...], int]:
    ranks = mesh.mesh.tolist()
    table = {}
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        value = ranks
        for c in coordinate:
            value = value[c]
        table[coordinate] = int(value)
    return table


def group_over_axes(mesh: DeviceMesh, axes: Sequence[int]) -> tuple[ProcessGroup, Members]:
    """This rank's group over ``axes`` of ``mesh`` and its members' mesh coordinates, in
    group-rank order.  Every rank of the mesh must call it alike (creating groups is collective).
    """
    axes = tuple(sorted(axes))
    key = (id(mesh), axes)
    cached = _cache.get(key)
    if cached is not None and cached[0] is mesh:
        return cached[1], cached[2]
    rank_at = _rank_at(mesh)
    me = dist.get_rank()
    rows: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for coordinate in sorted(rank_at):  # one row per coordinate on the other axes
        rest = tuple(c for a, c in enumerate(coordinate) if a not in axes)
        rows.setdefault(rest, []).append(coordinate)
    group, members = None, []
    for row in rows.values():
        by_rank = sorted(row, key=rank_at.__getitem__)  # group ranks follow global ranks
        ranks = [rank_at[c] for c in by_rank]
        if len(axes) == 1:
            created = mesh.get_group(axes[0]) if me in ranks else None
        elif len(rows) == 1 and sorted(ranks) == list(range(dist.get_world_size())):
            created = dist.group.WORLD
        else:  # every rank creates every group, in the same order
            created = dist.new_group(ranks)
        if me in ranks:
            group, members = created, by_rank
    _cache[key] = (mesh, group, members)
    return group, members
