"""The target's cheaper forward: FP8 linear layers (examples/dflash/fp8.py) and the
capture-layers-only forward of the Hugging Face target (examples/dflash/hf.py). The
Triton quantization kernel runs under TRITON_INTERPRET=1 on the CPU, in a child
interpreter (the mode is read when Triton is imported)."""

from __future__ import annotations

import copy
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from examples.dflash import fp8

# e4m3 keeps 3 mantissa bits: a rounding error of up to 2^-4 of each value, random in
# sign, and the GEMM's sums average it down. Row-wise scales on random data measure
# about 3.7 % of the output's norm (the project's facts: 3.7-3.8 % at the 23 B target's
# shapes); the bound leaves room, and a wrong scale or transposed weight is far beyond.
LINEAR_RTOL = 0.05

INTERPRETED_KERNEL = """
import torch
from examples.dflash import fp8
from pydflash.guards.interpreter import interpreting
assert interpreting()
generator = torch.Generator().manual_seed(0)
cases = []
shapes = [(torch.bfloat16, 33, 300), (torch.float32, 5, 5000), (torch.bfloat16, 4, 64)]
for dtype, rows, k in shapes:
    x = torch.randn(rows, k, generator=generator).to(dtype) * 3
    x[0] = 0  # an all-zero row
    x[1, :7] = 1e-6  # values that fall into e4m3's subnormals
    x[2, 0] = 1e4  # one outlier: most of the row rounds to small values
    x[3] = torch.tensor([1.0, 432.0, 92.0, 100.0] * (k // 4))[:k].to(dtype)  # ties to even
    cases.append(x)
cases.append(torch.randn(8, 128, generator=generator)[:, :100])  # strided rows
for x in cases:
    q, scale = fp8.quantize_rows(x)
    ref_q, ref_scale = fp8.quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (x.shape[0], 1)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), x.dtype
    assert torch.equal(scale, ref_scale)
print("ok", len(cases))
"""


def test_quantization_kernel_interpreted_equals_the_reference(python_subprocess_env):
    pytest.importorskip("triton")
    env = {**python_subprocess_env, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETED_KERNEL],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,  # the test reads the status
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok", "4"]


def test_reference_quantization_scales_rows_to_the_fp8_range():
    x = torch.randn(16, 96) * torch.logspace(-3, 3, 16)[:, None]
    q, scale = fp8.quantize_rows_reference(x)
    assert torch.equal(q.float().abs().amax(-1), torch.full((16,), fp8.FP8_MAX))
    assert torch.allclose(scale.squeeze(1), x.abs().amax(-1) / fp8.FP8_MAX)
    back = q.float() * scale
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale * 2**-9).all()  # half an e4m3 ulp
    zero_q, zero_scale = fp8.quantize_rows_reference(torch.zeros(2, 32))
    assert not zero_q.float().any() and (zero_scale > 0).all()


@pytest.mark.parametrize(
    ("k", "n", "bias"), [(256, 512, False), (1024, 256, True), (96, 48, False)]
)
def test_fp8_linear_is_within_its_error_bound_of_fp32(k, n, bias):
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=bias)
    x = torch.randn(3, 50, k)
    layer = fp8.FP8Linear(linear)
    with torch.no_grad():
        want, got = linear(x), layer(x)
    assert got.shape == want.shape and got.dtype == x.dtype
    error = ((got - want).norm() / want.norm()).item()
    assert 1e-3 < error < LINEAR_RTOL  # quantized (not a copy of the weight), within bound
    # The emulation is the product its definition gives, from the kernel's own pieces.
    q, scale = fp8.quantize_rows_reference(x.reshape(-1, k))
    exact = (q.float() * scale) @ layer.dequantized_weight().t()
    if bias:
        exact = exact + linear.bias
    assert torch.allclose(got.reshape(-1, n), exact, rtol=1e-5, atol=1e-5)


def test_to_fp8_swaps_only_fitting_linears_and_survives_a_dtype_move():
    model = nn.Sequential(nn.Linear(64, 32), nn.Sequential(nn.Linear(32, 8)), nn.Embedding(10, 64))
    before = model[0].weight.clone()
    assert fp8.to_fp8(model) is model
    assert isinstance(model[0], fp8.FP8Linear)
    assert type(model[1][0]) is nn.Linear  # N = 8: not a multiple of 16
    assert type(model[2]) is nn.Embedding
    weight = model[0].dequantized_weight()
    model.to(torch.bfloat16)  # what build_models does: the fp8 bits and scales stay
    assert model[0].weight_bits.dtype == torch.uint8
    assert torch.equal(model[0].dequantized_weight(), weight)
    assert ((weight - before).abs() <= before.abs() * 2**-4 + 1e-6).all()
    assert model[0](torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_to_fp8_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="expected granularity in"):
        fp8.to_fp8(nn.Linear(16, 16), granularity="tensor")
    with pytest.raises(ValueError, match="expected backend in"):
        fp8.to_fp8(nn.Linear(16, 16), backend="cublas")
    with pytest.raises(ValueError, match="expected a CUDA device for torchao"):
        fp8.to_fp8(nn.Linear(16, 16), backend="torchao")
    with pytest.raises(ValueError, match="expected a module"):
        fp8.to_fp8(None)
    with pytest.raises(ValueError, match="expected a 2-D tensor"):
        fp8.quantize_rows(torch.zeros(2, 3, 4))


# --- the Hugging Face target ---------------------------------------------------------------
transformers = pytest.importorskip("transformers")

from examples.dflash.hf import HFTargetConfig  # noqa: E402

TINY = "qwen3-next-tiny"


def _all_hidden_states(model, ids):
    with torch.no_grad():
        return model.model.model(input_ids=ids, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("layers", [(0, 2), (1,), (0, 1, 3), (3,)])
def test_capture_layers_only_forward_equals_all_hidden_states(layers):
    config = HFTargetConfig.load(TINY, layers)
    torch.manual_seed(0)
    model = config.build()
    ids = torch.randint(0, config.vocab, (2, 20))
    states = _all_hidden_states(model, ids)
    ran = []
    for i, layer in enumerate(model.decoder_layers()):
        layer.register_forward_pre_hook(lambda *_, i=i: ran.append(i))
    with torch.no_grad():
        features = model(ids)
    assert torch.equal(features, torch.cat([states[i + 1] for i in layers], dim=-1))
    assert ran == list(range(max(layers) + 1))  # the layers after the last one do not run
    ran.clear()
    with torch.no_grad():  # the model called directly still runs whole, hooks idle
        model.model.model(input_ids=ids)
    assert ran == [0, 1, 2, 3]


def test_capture_forward_deep_copies():
    """The example copies the target to each further target device."""
    torch.manual_seed(0)
    model = HFTargetConfig.load(TINY, (0, 2)).build(fp8=True)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, model.model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(twin(ids), model(ids))


def test_capture_forward_from_threads_at_once():
    config = HFTargetConfig.load(TINY, (0, 2))
    torch.manual_seed(0)
    model = config.build()
    inputs = [torch.randint(0, config.vocab, (1, 16 + i)) for i in range(4)]
    with torch.no_grad():
        want = [model(ids) for ids in inputs]
    barrier = threading.Barrier(len(inputs))
    got: list = [None] * len(inputs)

    def run(i: int) -> None:
        barrier.wait()
        with torch.no_grad():
            for _ in range(5):
                got[i] = model(inputs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("whole", [False, True])
def test_to_fp8_of_a_whole_target_keeps_its_head(whole):
    from examples.dflash.models import TINY_TARGET

    for target in (HFTargetConfig.load(TINY, (1, 3)).build(), TINY_TARGET.build()):
        head = target.get_output_embeddings()
        layers = target.decoder_layers() if hasattr(target, "decoder_layers") else target.layers
        fp8.to_fp8(target if whole else layers)
        assert target.get_output_embeddings() is head and type(head) is nn.Linear
        assert any(isinstance(m, fp8.FP8Linear) for m in layers.modules())


def test_fp8_target_keeps_embedding_and_head_and_stays_close():
    config = HFTargetConfig.load(TINY, (1, 3))
    torch.manual_seed(0)
    plain = config.build()
    torch.manual_seed(0)
    quantized = HFTargetConfig.load(TINY, (1, 3)).build(fp8=True)
    mlp = quantized.decoder_layers()[0].mlp
    assert isinstance(mlp.gate_proj, fp8.FP8Linear)
    assert type(quantized.get_output_embeddings()) is nn.Linear
    assert torch.equal(
        quantized.get_output_embeddings().weight, plain.get_output_embeddings().weight
    )
    ids = torch.randint(0, config.vocab, (2, 24))
    with torch.no_grad():
        want, got = plain(ids), quantized(ids)
    error = ((got - want).norm() / want.norm()).item()
    assert 0 < error < LINEAR_RTOL


def test_example_trains_with_target_fp8(run_child_module, tmp_path):
    result = run_child_module(
        "examples.train_dflash_online",
        *("--tiny", "--target-config", TINY, "--target-fp8", "--steps", "2", "--log-every", "1"),
        *("--no-plot", "--out", str(tmp_path)),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loss" in result.stdout


# --- on a GPU ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_quantization_and_scaled_mm_on_gpu():
    torch.manual_seed(0)
    x = torch.randn(1000, 5120, device="cuda", dtype=torch.bfloat16) * 2
    x[0] = 0
    q, scale = fp8.quantize_rows(x)
    ref_q, ref_scale = fp8.quantize_rows_reference(x)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
    linear = nn.Linear(5120, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = fp8.FP8Linear(linear)
    with torch.no_grad():
        got = layer(x)
        emulated = fp8._fp8_linear(x.cpu(), layer.weight_fp8.cpu(), layer.weight_scale.cpu(), None)
        want = linear(x).float()
    assert ((got.float().cpu() - emulated.float()).norm() / emulated.float().norm()) < 1e-2
    assert ((got.float() - want).norm() / want.norm()) < LINEAR_RTOL
