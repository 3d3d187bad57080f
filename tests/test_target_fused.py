"""Fused elementwise modules for the Hugging Face Qwen3-Next target
(examples/dflash/fused.py). On a CPU each fused module runs transformers' math in torch:
the features equal the unfused model's. A stand-in `fla` package with FLA's documented
signatures and layouts (torch code) checks how the modules call FLA's kernels; the
kernels themselves are checked against transformers' modules on a GPU."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from examples.dflash import fused
from examples.dflash.hf import HFTargetConfig

TINY = "qwen3-next-tiny"


IDS = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))


def build(fusions=(), fp8=False):
    torch.manual_seed(1)
    return HFTargetConfig.load(TINY, (0, 2)).build(fused=fusions, fp8=fp8)


def features(fusions=(), fp8=False, model=None):
    model = build(fusions, fp8) if model is None else model
    with torch.no_grad():
        return model(IDS), model


def test_parse_fusions():
    assert fused.parse_fusions("conv,norms") == ("norms", "conv")
    assert fused.parse_fusions("fla") == ("norms", "swiglu", "conv")
    assert fused.parse_fusions("all") == fused.FUSIONS
    assert fused.parse_fusions(["swiglu"]) == ("swiglu",)
    assert fused.parse_fusions("") == fused.parse_fusions(None) == ()
    with pytest.raises(ValueError, match="expected fusions from"):
        fused.parse_fusions("norms,rope")


@pytest.mark.parametrize("fusions", [("norms",), ("swiglu",), ("conv",), ("norms", "swiglu")])
def test_fused_modules_equal_transformers_math_on_cpu(fusions):
    want, _ = features()
    got, model = features(fusions)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    layer = model.decoder_layers()[0]
    if "norms" in fusions:
        assert isinstance(layer.input_layernorm, fused.ZeroCentredRMSNorm)
        assert isinstance(layer.linear_attn.norm, fused.GatedRMSNorm)
    if "swiglu" in fusions:
        assert isinstance(layer.mlp, fused.FusedMLP)


def test_merged_projection_is_quantized_with_fp8():
    want, _ = features(fp8=True)
    got, model = features(("swiglu",), fp8=True)
    from examples.dflash.fp8 import FP8Linear

    assert isinstance(model.decoder_layers()[1].mlp.gate_up, FP8Linear)
    # Row-wise weight scales per output channel: merging gate and up changes nothing.
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


# --- through a stand-in for FLA's functions ---------------------------------------------------
@pytest.fixture
def stand_in_fla(monkeypatch):
    """`fla` modules with FLA 0.6.0's signatures and layouts, computing in fp32 as its
    kernels do; records each call. fused.py then takes its FLA path on CPU tensors.
    Build the models before asking for it (building looks for the real package)."""
    calls: list[str] = []

    def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
        calls.append("rms_norm")
        assert bias is None and residual is None and weight.dtype == torch.float32
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)

    def rms_norm_gated(x, g, weight, bias, activation="swish", eps=1e-6, **_):
        calls.append("rms_norm_gated")
        assert activation == "swish" and bias is None
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return (y * F.silu(g.float())).to(x.dtype)

    def swiglu(x, y):
        calls.append("swiglu")
        return (F.silu(x.float()) * y.float()).to(x.dtype)

    def causal_conv1d(x, weight=None, bias=None, residual=None, activation=None, **kwargs):
        calls.append("causal_conv1d")
        length, dim = x.shape[1:]  # FLA's layout: [B, T, D]
        assert weight.shape[0] == dim and residual is None
        y = F.conv1d(
            x.transpose(1, 2), weight[:, None], bias, padding=weight.shape[1] - 1, groups=dim
        )
        y = y[..., :length].transpose(1, 2)
        return (F.silu(y) if activation in ("silu", "swish") else y), None

    modules = {
        "fla": types.ModuleType("fla"),
        "fla.modules": types.ModuleType("fla.modules"),
        "fla.modules.norm": types.ModuleType("fla.modules.norm"),
        "fla.modules.norm.layernorm": types.ModuleType("fla.modules.norm.layernorm"),
        "fla.modules.norm.fused_norm_gate": types.ModuleType("fla.modules.norm.fused_norm_gate"),
        "fla.modules.activations": types.ModuleType("fla.modules.activations"),
        "fla.modules.causal_conv1d": types.ModuleType("fla.modules.causal_conv1d"),
    }
    modules["fla.modules.norm.layernorm"].rms_norm = rms_norm
    modules["fla.modules.norm.fused_norm_gate"].rms_norm_gated = rms_norm_gated
    modules["fla.modules.activations"].swiglu = swiglu
    modules["fla.modules.causal_conv1d"].causal_conv1d = causal_conv1d
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(fused, "_on_fla", lambda x: True)
    monkeypatch.setattr(fused, "_takes_fla", lambda module, x: True)
    return calls


@pytest.fixture
def plain_and_fused():
    return build(), build(fused.KERNELS), build(("conv",))


def test_fla_path_layouts_and_arguments(plain_and_fused, stand_in_fla):
    want, _ = features(model=plain_and_fused[0])
    assert stand_in_fla == []
    got, _ = features(model=plain_and_fused[1])
    assert set(stand_in_fla) == {"rms_norm", "rms_norm_gated", "swiglu", "causal_conv1d"}
    # fp32 throughout on a CPU target: the same values up to the order of operations.
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fla_conv_only_inside_the_model_that_opted_in(plain_and_fused, stand_in_fla):
    plain, _, conv = plain_and_fused
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        plain(ids)
    assert stand_in_fla == []
    with torch.no_grad():
        conv(ids)
    assert stand_in_fla.count("causal_conv1d") == 3  # layers 0-2 run; 0, 1, 2 are linear
    stand_in_fla.clear()
    with torch.no_grad():
        plain(ids)
    assert stand_in_fla == []


# --- on a GPU, FLA's kernels ------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_reference():
    """transformers' Qwen3-Next-small in bf16 and the same weights in fp32, on one input:
    (config, ids, bf16 features, fp32 features), computed once for every fusion."""
    config = HFTargetConfig.load("qwen3-next-small", (1, 4, 6))
    ids = torch.randint(0, config.vocab, (2, 1024), device="cuda:0")
    torch.manual_seed(0)
    plain = config.build(torch.bfloat16, "cuda:0")
    with torch.no_grad():
        want = plain(ids).float()
        exact = copy.deepcopy(plain).float()(ids)  # the same weights, computed in fp32
    return config, ids, want, exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fusions", [("norms",), ("swiglu",), ("conv",), ("compile",), "all"])
def test_fused_target_matches_transformers_on_gpu(fusions, gpu_reference):
    if fusions != ("compile",) and not fused.fla_available():
        pytest.skip("needs flash-linear-attention")
    config, ids, want, exact = gpu_reference
    torch.manual_seed(0)
    model = config.build(torch.bfloat16, "cuda:0", fused=fused.parse_fusions(fusions))
    with torch.no_grad():
        got = model(ids).float()
        again = model(ids).float()
    # bf16 rounding in a different order (FLA and Inductor round each fused expression
    # once), and random weights amplify any rounding layer after layer: the fused target
    # is held to transformers' own bf16 error against fp32, not to transformers' bf16.
    error = ((got - exact).norm() / exact.norm()).item()
    plain_error = ((want - exact).norm() / exact.norm()).item()
    assert error < 2 * plain_error + 1e-3, (error, plain_error)
    assert torch.equal(got, again)
