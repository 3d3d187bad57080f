"""examples/train_dflash_online.py's parts: synthetic data (`data`), the target and
drafter models (`models`, `gated_delta`), Hugging Face targets (`hf`) and the three
training loops (`loops`)."""

from . import data, gated_delta, hf, loops, models

__all__ = ["data", "gated_delta", "hf", "loops", "models"]
