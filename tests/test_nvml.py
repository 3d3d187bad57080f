"""pydflash.graphs.nvml: the busy share NVML gives a device, found by its UUID, and None
wherever NVML cannot say (no library, no device, a failed call)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from pydflash.graphs import nvml


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(nvml, "_library", None)
    monkeypatch.setattr(nvml, "_handles", {})


class FakeNvml:
    """NVML's calls as ctypes makes them: return codes, results through pointers."""

    def __init__(self, busy_percent=97):
        self.busy_percent = busy_percent
        self.rc = 0
        self.asked = []

    def nvmlInit_v2(self):
        return 0

    def nvmlDeviceGetHandleByUUID(self, uuid, handle):
        self.asked.append(uuid)
        handle._obj.value = 7
        return 0

    def nvmlDeviceGetUtilizationRates(self, handle, utilization):
        assert handle.value == 7
        utilization._obj.gpu = self.busy_percent
        return self.rc


def test_without_the_library_there_is_no_share(monkeypatch):
    monkeypatch.setattr(nvml, "LIBRARY", "libnvidia-ml-not-here.so.1")
    assert nvml.busy_share(0) is None
    assert nvml._library is False  # not looked for again


def test_the_share_is_nvmls_percent_of_its_sample_period(monkeypatch):
    fake = FakeNvml(busy_percent=97)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    properties = SimpleNamespace(uuid="1a2b-3c")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    assert nvml.busy_share(0) == pytest.approx(0.97)
    assert nvml.busy_share(0) == pytest.approx(0.97)
    assert fake.asked == [b"GPU-1a2b-3c"]  # found by its UUID once, then kept
    fake.rc = 999  # NVML_ERROR_UNKNOWN
    assert nvml.busy_share(0) is None


def test_a_device_nvml_does_not_know_has_no_share(monkeypatch):
    fake = FakeNvml()
    fake.nvmlDeviceGetHandleByUUID = lambda uuid, handle: 13  # NVML_ERROR_NOT_FOUND
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    properties = SimpleNamespace(uuid="MIG-4d5e")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    assert nvml.busy_share(1) is None
