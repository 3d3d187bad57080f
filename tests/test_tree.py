"""pydflash._tree: pytree's answers, by a fast path for flat containers of tensors."""

import collections

import pytest

torch = pytest.importorskip("torch")
from torch.utils import _pytree as pytree  # noqa: E402

from pydflash._tree import flatten, map_tensors, tensors, unflatten  # noqa: E402

Pair = collections.namedtuple("Pair", "a b")
T = torch.arange(3.0)
TREES = [
    {"input_ids": T, "hidden": T + 1},
    {"b": T, "a": T + 1},  # insertion order, as pytree keeps it
    [T, T + 1],
    (T,),
    T,
    {},
    (),
    {"ids": T, "n": 3},  # a non-tensor leaf: pytree's walk
    {"nested": [T, (T + 1,)]},
    Pair(T, T + 1),  # a namedtuple is not a plain tuple
    [T, None],
]


@pytest.mark.parametrize("tree", TREES, ids=lambda t: type(t).__name__)
def test_flatten_and_unflatten_give_what_pytree_gives(tree):
    for _ in range(2):  # the second time from the remembered layout
        leaves, spec = flatten(tree)
        want_leaves, want_spec = pytree.tree_flatten(tree)
        assert spec == want_spec
        assert len(leaves) == len(want_leaves)
        assert all(a is b for a, b in zip(leaves, want_leaves, strict=True))
        rebuilt = unflatten(leaves, spec)
        want = pytree.tree_unflatten(want_leaves, want_spec)
        assert type(rebuilt) is type(want)
        assert pytree.tree_flatten(rebuilt)[1] == want_spec
        assert all(a is b for a, b in zip(pytree.tree_leaves(rebuilt), want_leaves, strict=True))


@pytest.mark.parametrize("tree", TREES, ids=lambda t: type(t).__name__)
def test_tensors_and_map_tensors_give_what_pytree_gives(tree):
    want = [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
    assert [id(x) for x in tensors(tree)] == [id(x) for x in want]
    mapped = map_tensors(lambda t: t * 2, tree)
    expected = pytree.tree_map_only(torch.Tensor, lambda t: t * 2, tree)
    assert type(mapped) is type(expected)
    got, spec = pytree.tree_flatten(mapped)
    ref, ref_spec = pytree.tree_flatten(expected)
    assert spec == ref_spec
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_unflatten_of_a_spec_it_did_not_make_uses_pytree():
    leaves, spec = pytree.tree_flatten({"x": T, "y": T})
    assert unflatten(leaves, spec).keys() == {"x", "y"}
    with pytest.raises((ValueError, TypeError)):
        unflatten([T], flatten({"p": T, "q": T})[1])  # too few leaves: pytree's error
