"""Where this process sits in the job: read from torchrun or SLURM environment variables.

Kept free of torch.distributed so the parsing can be unit-tested without starting anything.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """Rank layout and rendezvous address of one process of a launched job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" or "slurm"


def from_torchrun(env: Mapping[str, str]) -> LaunchEnv | None:
    """Layout from torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank = int(env["RANK"])
    return LaunchEnv(
        rank=rank,
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", rank)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
        launcher="torchrun",
    )


def from_slurm(env: Mapping[str, str]) -> LaunchEnv | None:
    """Layout from srun; the master is the first host of the job's node list."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if "MASTER_ADDR" in env:
        master_addr = env["MASTER_ADDR"]
    elif nodelist:
        master_addr = expand_nodelist(nodelist)[0]
    else:
        master_addr = "127.0.0.1"
    return LaunchEnv(
        rank=int(env["SLURM_PROCID"]),
        world_size=int(env["SLURM_NTASKS"]),
        local_rank=int(env.get("SLURM_LOCALID", 0)),
        master_addr=master_addr,
        master_port=int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
        launcher="slurm",
    )


def detect(env: Mapping[str, str]) -> LaunchEnv | None:
    """torchrun wins over SLURM (torchrun inside an salloc sets both); None means a lone process."""
    return from_torchrun(env) or from_slurm(env)


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as ``node[01-04,07],gpu3`` without calling scontrol.

    scontrol is not always on PATH inside containers, and the syntax is small: comma-separated
    hosts, each with zero or more bracket groups of comma-separated numbers or zero-padded ranges.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_host(item))
    if not hosts:
        raise ValueError(f"empty SLURM node list {nodelist!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM node list {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM node list {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


_BRACKET = re.compile(r"\[([^\]]*)\]")


def _expand_host(pattern: str) -> list[str]:
    """Expand the first bracket group, then recurse on the rest (cartesian product)."""
    match = _BRACKET.search(pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [head + value + rest for value in _expand_range_list(match.group(1)) for rest in _expand_host(tail)]


def _expand_range_list(spec: str) -> list[str]:
    values: list[str] = []
    for part in spec.split(","):
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"bad range {part!r} in SLURM node list")
        if not sep:
            values.append(low)
            continue
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values
