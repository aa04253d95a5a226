"""Communicator reuse: every torch.distributed group a split may need, created once at start-up.

For each possible number of train ranks k (multiples of `resize_unit`) three groups exist:
`train[k]` = ranks [0, k) for gradient reduction and shard gathering, `rollout[k]` = ranks
[k, world), and `sync[k]` = {0} + rollout ranks for broadcasting new weights. A switch then only
looks groups up. At NCCL scale a new communicator costs seconds to minutes; a lookup costs nothing.

`new_group` is collective over the whole world: every rank creates the same groups in the same
order. `creations` counts them so tests can show none happen after start-up. With reuse off
(benchmark baseline only) groups are created when first needed instead.
"""
from __future__ import annotations

import torch.distributed as dist


class GroupRegistry:
    def __init__(self, world: int, resize_unit: int, reuse: bool = True):
        self.world, self.unit, self.reuse = world, resize_unit, reuse
        self._groups: dict[tuple[str, int], object] = {}
        self.creations = 0
        self.splits = list(range(resize_unit, world, resize_unit))   # colocated (k = world) uses WORLD
        if reuse:
            for k in self.splits:
                self._create_split(k)
        self.creations_at_startup = self.creations

    @property
    def created_after_startup(self) -> int:
        return self.creations - self.creations_at_startup

    def members(self, kind: str, k: int) -> list[int]:
        if kind == "train":
            return list(range(k))
        if kind == "rollout":
            return list(range(k, self.world))
        if kind == "sync":
            return [0] + list(range(k, self.world))
        raise KeyError(kind)

    def get(self, kind: str, k: int):
        """The group `kind` (train, rollout, sync) of the split with k train ranks."""
        if k == self.world:                       # colocated: everyone trains, nobody needs a sync
            return dist.group.WORLD if kind == "train" else None
        if (kind, k) not in self._groups:
            if self.reuse or k not in self.splits:
                raise KeyError(f"no pre-created {kind} group for {k} train ranks (splits: {self.splits})")
            self._create_split(k)                 # reuse off: a collective, on every rank, now
        return self._groups[(kind, k)]

    def ensure(self, k: int) -> None:
        """Make sure the groups of split k exist: a lookup with reuse; a collective creation without.
        Called by every rank at the same point."""
        if k != self.world:
            for kind in ("train", "rollout", "sync"):
                self.get(kind, k)

    def release_unreused(self, k: int) -> None:
        """Reuse off: forget the groups of split k, so the next switch to it creates them anew."""
        if not self.reuse:
            for kind in ("train", "rollout", "sync"):
                self._groups.pop((kind, k), None)

    def _create_split(self, k: int) -> None:
        for kind in ("train", "rollout", "sync"):
            self._groups[(kind, k)] = dist.new_group(self.members(kind, k))
            self.creations += 1
