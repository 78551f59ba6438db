"""The rank rule the four adapters share: `spec_for_rank`.

Each adapter asks its own framework for this process's rank and world size and hands
them here as plain numbers. This module imports dmdask and no framework.
"""
from __future__ import annotations

import dmdask

__all__ = ["spec_for_rank"]


def spec_for_rank(spec: dmdask.Spec, rank: int, world_size: int, source: str) -> dmdask.Spec:
    """`spec` for process `rank` of `world_size`, as `source` (named in errors) reports them.

    A spec at the defaults rank=0, world_size=1 (given explicitly or not) takes `rank` and
    `world_size`; a spec that sets them must agree (ValueError naming both otherwise);
    `spec` itself comes back when it already says `rank` of `world_size`. The caller
    decides whether its framework runs distributed at all.
    """
    rank, world_size = int(rank), int(world_size)
    if (spec.rank, spec.world_size) == (rank, world_size):
        return spec
    if (spec.rank, spec.world_size) == (0, 1):
        return spec.replace(rank=rank, world_size=world_size)
    raise ValueError(
        f"Spec(rank={spec.rank}, world_size={spec.world_size}) disagrees with {source} "
        f"(rank={rank}, world_size={world_size}); leave the spec's rank and world_size at "
        f"their defaults to take them from {source}"
    )
