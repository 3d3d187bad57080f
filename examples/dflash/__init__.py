"""examples/train_dflash_online.py's parts: synthetic data (`data`), the target and
drafter models (`models`, `gated_delta`), Hugging Face targets (`hf`), their FP8 linear
layers (`fp8`) and fused elementwise modules (`fused`), and the three training loops
(`loops`)."""

from . import data, fp8, fused, gated_delta, hf, loops, models

__all__ = ["data", "fp8", "fused", "gated_delta", "hf", "loops", "models"]
