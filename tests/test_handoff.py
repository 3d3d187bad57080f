"""pydflash.lanes.handoff on any machine: the walk over a result's tensors, and a handoff
between CPU lanes (tests/test_cuda.py and tests/test_pipeline.py hand off on GPUs)."""

from __future__ import annotations

import collections

import pytest
import torch

import pydflash
from pydflash.lanes.handoff import hand_to_lane, map_tensors, tensors

Pair = collections.namedtuple("Pair", "first second")


def nested():
    a, b, c = torch.zeros(2), torch.ones(3, dtype=torch.int64), torch.full((1,), 7.0)
    tree = {"h": Pair(a, [b, "label", None]), "n": 4, "c": (c,)}
    return tree, [a, b, c]


def test_tensors_are_found_in_nested_containers_in_order():
    tree, expected = nested()
    found = tensors(tree)
    assert len(found) == len(expected)
    assert all(x is y for x, y in zip(found, expected, strict=True))
    assert tensors(torch.zeros(1))[0].shape == (1,)
    assert tensors({"no": [1, "tensor"]}) == []


def test_map_tensors_keeps_containers_and_other_leaves():
    tree, _ = nested()
    doubled = map_tensors(lambda t: t * 2, tree)
    assert isinstance(doubled["h"], Pair) and isinstance(doubled["h"].second, list)
    assert doubled["h"].second[1:] == ["label", None] and doubled["n"] == 4
    assert torch.equal(doubled["h"].second[0], torch.full((3,), 2, dtype=torch.int64))
    assert torch.equal(doubled["c"][0], torch.full((1,), 14.0))
    ordered = collections.OrderedDict(x=torch.ones(1))
    assert type(map_tensors(torch.Tensor.clone, ordered)) is collections.OrderedDict


@pytest.fixture
def cpu_lanes():
    dispatcher = pydflash.Dispatcher(["cpu", "cpu"])
    yield dispatcher.lanes
    dispatcher.shutdown()


def test_between_cpu_lanes_the_value_is_used_in_place(cpu_lanes):
    tree, _ = nested()
    src, dst = cpu_lanes
    moved, copied_bytes = dst.submit(hand_to_lane, tree, src, 0, dst).result()
    assert moved is tree and copied_bytes == 0
