"""The role table: which rank trains and which generates, versioned and identical on every rank.

Disaggregated tables are two contiguous blocks, train ranks first: [0, k) train, [k, world)
rollout. Contiguous blocks keep the set of possible splits (and so of pre-created groups) linear
in the world size, and let a resize unit be a node or a tensor-parallel group.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(str, enum.Enum):
    TRAIN = "train"
    ROLLOUT = "rollout"
    BOTH = "both"       # colocated: every rank generates, then every rank trains


@dataclass(frozen=True)
class RoleTable:
    version: int
    roles: tuple[Role, ...]

    @classmethod
    def split(cls, world: int, train_ranks: int, version: int = 0) -> "RoleTable":
        if not 1 <= train_ranks <= world - 1:
            raise ValueError(f"a split needs 1..{world - 1} train ranks of {world}, got {train_ranks}")
        return cls(version, (Role.TRAIN,) * train_ranks + (Role.ROLLOUT,) * (world - train_ranks))

    @classmethod
    def colocated(cls, world: int, version: int = 0) -> "RoleTable":
        return cls(version, (Role.BOTH,) * world)

    def __post_init__(self):
        if self.colocated_mode:
            return
        k = self.num_train
        if k == 0 or k == len(self.roles):
            raise ValueError(f"role table v{self.version} needs at least one train and one rollout rank")
        if self.roles[:k] != (Role.TRAIN,) * k:
            raise ValueError(f"role table v{self.version}: train ranks must be the contiguous block 0..{k - 1}")

    @property
    def world(self) -> int:
        return len(self.roles)

    @property
    def colocated_mode(self) -> bool:
        return all(r is Role.BOTH for r in self.roles)

    @property
    def num_train(self) -> int:
        """Ranks that train (all of them when colocated)."""
        return sum(r in (Role.TRAIN, Role.BOTH) for r in self.roles)

    @property
    def num_rollout(self) -> int:
        return sum(r in (Role.ROLLOUT, Role.BOTH) for r in self.roles)

    def train_ranks(self) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r in (Role.TRAIN, Role.BOTH)]

    def rollout_ranks(self) -> list[int]:
        return [i for i, r in enumerate(self.roles) if r in (Role.ROLLOUT, Role.BOTH)]

    def role_of(self, rank: int) -> Role:
        return self.roles[rank]

    def trains(self, rank: int) -> bool:
        return self.roles[rank] in (Role.TRAIN, Role.BOTH)

    def generates(self, rank: int) -> bool:
        return self.roles[rank] in (Role.ROLLOUT, Role.BOTH)

    def with_split(self, train_ranks: int) -> "RoleTable":
        """The next version of the table with `train_ranks` train ranks."""
        return RoleTable.split(self.world, train_ranks, self.version + 1)

    def describe(self) -> str:
        if self.colocated_mode:
            return f"{self.world}C"
        return f"{self.num_train}T/{self.num_rollout}R"
