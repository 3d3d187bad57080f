"""bench/fused_loss_compare.py: on a CPU it runs its code path at toy shapes, says so,
and says when liger-kernel is missing; its fp64 reference is the plain loss."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from bench import fused_loss_compare
from examples.dflash.fused_loss import liger_linear_cross_entropy


def test_reference_is_the_plain_weighted_cross_entropy():
    x = fused_loss_compare.inputs(40, 8, 30, "cpu")
    loss, grad = fused_loss_compare.reference(x, chunk=7)
    h = x["hidden"].double().requires_grad_(True)
    plain = torch.nn.functional.cross_entropy(
        h @ x["weight"].double().t(), x["labels"], reduction="none"
    )
    (plain * x["weights"].double()).sum().backward()
    assert loss == pytest.approx((plain * x["weights"].double()).sum().item(), rel=1e-12)
    torch.testing.assert_close(grad, h.grad)
    assert (x["weights"] == 0).any() and x["weights"].sum().item() == pytest.approx(1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke")
def test_cpu_smoke_measures_the_chunked_kernel_and_says_why_not_more(tmp_path, capsys):
    assert fused_loss_compare.main(["--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rows"] and all(r["kernel"].startswith("chunked") for r in report["rows"])
    assert all(r["loss_rel_err"] < 1e-5 and r["grad_rel_err"] < 1e-5 for r in report["rows"])
    out = capsys.readouterr().out
    assert "no GPU: a CPU smoke" in out
    if importlib.util.find_spec("liger_kernel") is None:
        assert "liger-kernel is not installed" in out


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger is here")
def test_the_liger_kernel_without_the_package_says_how_to_install_it():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ModuleNotFoundError, match="pip install liger-kernel"):
        liger_linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_liger_kernel_matches_the_chunked_one_on_a_gpu():
    pytest.importorskip("liger_kernel")
    x = fused_loss_compare.inputs(512, 256, 4000, "cuda")
    loss, grad = fused_loss_compare.reference(x)
    for fn in (fused_loss_compare.KERNELS["chunked (example), chunk 1024"],
               fused_loss_compare.KERNELS["liger, weighted (reduction none)"]):  # fmt: skip
        h = x["hidden"].detach().requires_grad_(True)
        got = fn({**x, "hidden": h})
        got.backward()
        assert got.item() == pytest.approx(loss, rel=1e-2)
        assert ((h.grad.double() - grad).norm() / grad.norm()).item() < 2e-2
