"""Walks over batches and results on the per-microbatch path: torch.utils._pytree's
answers, with a fast path for what batches and hidden states almost always are, a dict,
list or tuple holding tensors only. pytree's generic walk costs tens of µs per call, and
a replayed microbatch makes a dozen of them on its lanes' threads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

_MAX_SPECS = 256  # distinct flat layouts remembered; more are flattened by pytree
# (type, dict keys or length) -> the TreeSpec pytree gives that layout.
_specs: dict[tuple, pytree.TreeSpec] = {}
# id(spec) -> (spec, type, dict keys or None), to rebuild without hashing the TreeSpec.
_layouts: dict[int, tuple[pytree.TreeSpec, type, tuple | None]] = {}


def _flat(tree: Any) -> list[torch.Tensor] | None:
    """The items of a dict, list or tuple (exactly those types) of tensors, else None."""
    kind = type(tree)
    if kind is dict:
        values = list(tree.values())
    elif kind is list or kind is tuple:
        values = list(tree)
    else:
        return None
    for value in values:
        if not isinstance(value, torch.Tensor):
            return None
    return values


def flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """pytree.tree_flatten(tree)."""
    values = _flat(tree)
    if values is None:
        return pytree.tree_flatten(tree)
    kind = type(tree)
    keys = tuple(tree) if kind is dict else None
    layout = (kind, keys if keys is not None else len(values))
    spec = _specs.get(layout)
    if spec is None:
        spec = pytree.tree_flatten(tree)[1]
        if len(_specs) < _MAX_SPECS:
            _specs[layout] = spec
            _layouts[id(spec)] = (spec, kind, keys)
    return values, spec


def unflatten(leaves: list[Any], spec: pytree.TreeSpec) -> Any:
    """pytree.tree_unflatten(leaves, spec)."""
    known = _layouts.get(id(spec))
    if known is None or known[0] is not spec or len(leaves) != spec.num_leaves:
        return pytree.tree_unflatten(leaves, spec)
    _, kind, keys = known
    if keys is not None:
        return dict(zip(keys, leaves, strict=True))
    return kind(leaves)


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in `tree`, in pytree's leaf order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = _flat(tree)
    if values is not None:
        return values
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """`tree` with fn(t) in place of each tensor t; containers are rebuilt with their own
    types, other leaves kept (pytree.tree_map_only)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    values = _flat(tree)
    if values is None:
        return pytree.tree_map_only(torch.Tensor, fn, tree)
    if type(tree) is dict:
        return {key: fn(value) for key, value in tree.items()}
    return type(tree)(fn(value) for value in values)
