"""Records that compare by value: two interventions, edits or variants are equal when their
fields are, tensors included (the same shape and the same numbers), never by identity."""

from __future__ import annotations

import dataclasses

import torch


def same(a, b) -> bool:
    """Whether two field values are the same value: tensors by shape, dtype and numbers,
    sequences and dicts element by element, anything else by `==`."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and (a is b or (a.shape == b.shape and a.dtype == b.dtype
                                and bool(torch.equal(a, b.to(a.device))))))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(
            same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if _record(a) or _record(b):  # a user's dataclass may hold tensors: field by field
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a) if f.compare)
    return bool(a == b)


def key(value):
    """A hashable stand-in for a field value: a tensor by its shape (equal tensors have
    equal shapes; the numbers are compared by `same`)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape))
    if isinstance(value, (tuple, list)):
        return tuple(key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, key(v)) for k, v in value.items()))
    if _record(value):
        return (type(value).__qualname__, *(key(getattr(value, f.name))
                                            for f in dataclasses.fields(value) if f.compare))
    return value


def _record(value) -> bool:
    """A dataclass instance (not the class)."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


class Value:
    """A dataclass mixin (with `eq=False`): equality and hashing by the fields' values."""

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(same(getattr(self, f.name), getattr(other, f.name))
                   for f in dataclasses.fields(self) if f.compare)

    def __hash__(self) -> int:
        return hash((type(self).__qualname__, *(key(getattr(self, f.name))
                                                 for f in dataclasses.fields(self) if f.compare)))
