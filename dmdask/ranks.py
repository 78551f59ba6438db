"""This process's place in a launch (`torchrun`, `srun`, a plain run): `rank_from_environment`.
Imports no framework."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Rank", "rank_from_environment"]

_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


@dataclass(frozen=True)
class Rank:
    """rank of world_size (0 <= rank < world_size); local_rank: its index on its node
    (the GPU it should use); launcher: who said so ("torchrun", "Slurm" or "none")."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str

    @property
    def device(self) -> str:
        """The CUDA device of this rank on its node, "cuda:<local_rank>"."""
        return f"cuda:{self.local_rank}"


def rank_from_environment(env: Mapping[str, str] | None = None) -> Rank:
    """This process's rank, from the variables the launcher sets: torchrun's (`RANK`,
    `WORLD_SIZE`, `LOCAL_RANK`), else Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`,
    `SLURM_LOCALID`), else rank 0 of 1. ValueError naming the variable when one is not a
    number or the rank is outside 0..world_size-1."""
    env = os.environ if env is None else env
    for launcher, rank_name, size_name, local_name in _LAUNCHERS:
        if env.get(rank_name) is None or env.get(size_name) is None:
            continue
        rank, size = _number(env, rank_name), _number(env, size_name)
        local = _number(env, local_name) if env.get(local_name) is not None else 0
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"{rank_name}={rank} is not a rank of {size_name}={size} (0..{size - 1})")
        return Rank(rank, size, local, launcher)
    return Rank(0, 1, 0, "none")


def _number(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not a number (set by the launcher: torchrun or srun)") from None
