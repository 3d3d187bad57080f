"""examples/train_dflash_online.py's parts: synthetic data (`data`) and a user's JSONL
(`jsonl`), the target and drafter models (`models`, `gated_delta`), Hugging Face targets
(`hf`), their FP8 linear layers (`fp8`) and fused elementwise modules (`fused`), DFlash's
objective (`objective`, `fused_loss`), the three training loops (`loops`) and the driver
that runs one (`training`), checkpoints (`checkpoint`), export (`export`), what a run
reports (`metrics`) and the script's own flags (`cli`)."""

from . import (
    checkpoint,
    cli,
    data,
    export,
    fp8,
    fused,
    gated_delta,
    hf,
    jsonl,
    loops,
    metrics,
    models,
    objective,
    training,
)

__all__ = [
    "checkpoint",
    "cli",
    "data",
    "export",
    "fp8",
    "fused",
    "gated_delta",
    "hf",
    "jsonl",
    "loops",
    "metrics",
    "models",
    "objective",
    "training",
]
