"""Roles follow from the plan and the rank, identically on every process.

Trainers take the first ranks (so global rank 0 is ``trainer0`` and prints progress), the
parameter servers the last ``num_servers`` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Role:
    """What one process does in a hybrid job."""

    rank: int
    """Global rank (torchrun's RANK)."""
    world_size: int
    """All processes: trainers plus servers."""
    num_servers: int
    """Parameter-server processes."""

    @property
    def num_trainers(self) -> int:
        return self.world_size - self.num_servers

    @property
    def kind(self) -> Literal["trainer", "ps"]:
        return "trainer" if self.rank < self.num_trainers else "ps"

    @property
    def is_trainer(self) -> bool:
        return self.kind == "trainer"

    @property
    def index(self) -> int:
        """Rank among processes of the same kind (trainer rank in the trainers' group)."""
        return self.rank if self.is_trainer else self.rank - self.num_trainers

    @property
    def name(self) -> str:
        """Stable RPC worker name: ``trainer0``, ``ps1``, ..."""
        return f"{self.kind}{self.index}"

    @property
    def trainer_names(self) -> list[str]:
        return trainer_names(self.num_trainers)

    @property
    def server_names(self) -> list[str]:
        return server_names(self.num_servers)


def trainer_names(n: int) -> list[str]:
    return [f"trainer{i}" for i in range(n)]


def server_names(n: int) -> list[str]:
    return [f"ps{i}" for i in range(n)]


def role_of(rank: int, world_size: int, num_servers: int) -> Role:
    """The role of ``rank``; raises ``ValueError`` when the topology cannot fit."""
    if num_servers < 0:
        raise ValueError(f"topology.parameter_servers must be >= 0, got {num_servers}")
    if world_size - num_servers < 1:
        raise ValueError(
            f"topology.parameter_servers={num_servers} leaves no trainer in WORLD_SIZE={world_size}: "
            f"start at least {num_servers + 1} processes or lower parameter_servers"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside WORLD_SIZE={world_size}")
    return Role(rank=rank, world_size=world_size, num_servers=num_servers)
