"""One flat parameter vector: the layout that makes sharding, weight sync and staging range arithmetic.

All parameters of the model, in `named_parameters()` order, are views into one contiguous 1-D
buffer. Training state is sharded over train ranks by contiguous ranges of that vector, so moving
a rank in or out of training only changes which ranges a rank owns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.model import trainable_parameters


@dataclass(frozen=True)
class FlatLayout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def of(cls, model) -> "FlatLayout":
        names, shapes, offsets, total = [], [], [], 0
        for name, p in trainable_parameters(model):
            names.append(name)
            shapes.append(tuple(p.shape))
            offsets.append(total)
            total += p.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), total)

    def views(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views of `flat` in parameter order (no copies)."""
        out = []
        for name, shape, off in zip(self.names, self.shapes, self.offsets):
            n = int(torch.Size(shape).numel())
            out.append((name, flat[off:off + n].view(shape)))
        return out


def bind_model_to_flat(model, layout: FlatLayout, flat: torch.Tensor) -> None:
    """Make every parameter of `model` a view into `flat` (after copying its values in)."""
    params = dict(trainable_parameters(model))
    for name, view in layout.views(flat):
        view.copy_(params[name].data)
        params[name].data = view


def model_to_flat(model, layout: FlatLayout, dtype=torch.float32) -> torch.Tensor:
    params = dict(trainable_parameters(model))
    return torch.cat([params[name].detach().reshape(-1).to(dtype) for name in layout.names])


