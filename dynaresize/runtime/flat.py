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

    def views(self, flat: torch.Tensor, lo: int = 0, hi: int | None = None) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views of `flat` in parameter order (no copies); of parameters lo..hi-1
        only when given, `flat` then holding just those (a weight-sync bucket)."""
        hi = len(self.names) if hi is None else hi
        base = self.offsets[lo] if lo < len(self.offsets) else self.numel
        out = []
        for name, shape, off in zip(self.names[lo:hi], self.shapes[lo:hi], self.offsets[lo:hi]):
            n = int(torch.Size(shape).numel())
            out.append((name, flat[off - base:off - base + n].view(shape)))
        return out

    def span(self, lo: int, hi: int) -> int:
        """Elements of parameters lo..hi-1."""
        return (self.offsets[hi] if hi < len(self.offsets) else self.numel) - self.offsets[lo]

    def buckets(self, max_bytes: int, element_size: int = 4) -> list[tuple[int, int]]:
        """Parameter index ranges [lo, hi) of at most `max_bytes` each, in order (a parameter
        larger than that alone): the weight sync's unit."""
        out, lo = [], 0
        for i in range(1, len(self.names) + 1):
            if i == len(self.names) or self.span(lo, i + 1) * element_size > max_bytes:
                out.append((lo, i))
                lo = i
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


