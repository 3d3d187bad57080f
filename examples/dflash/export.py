"""The trained drafter as a Hugging Face-style directory, and back.

    export(drafter, "out/drafter", target_layers=(1, 9, 17, 25, 33))
    drafter = load("out/drafter")          # a BlockDrafter with the same outputs

The directory holds `config.json` (the architecture, its dimensions, the block size,
the target's capture layers and the loss decay gamma, and the exact DrafterConfig) and
`model.safetensors` with every weight, the frozen embedding and head included, so the
directory alone rebuilds the drafter. It is written to a temporary directory beside
DIR and renamed over it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from .models import BlockDrafter, DrafterConfig, TargetShapes

ARCHITECTURE = "DFlashBlockDrafter"
MODEL_TYPE = "pydflash-dflash"


def config(drafter: BlockDrafter, target_layers: tuple[int, ...]) -> dict[str, Any]:
    """config.json's content for `drafter`, conditioned on `target_layers`."""
    cfg = drafter.cfg
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": drafter.embed.embedding_dim,
        "vocab_size": drafter.embed.num_embeddings,
        "target_hidden_size": drafter.fc.in_features,  # the features' width
        "target_layer_ids": list(target_layers),
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads_,
        "head_dim": cfg.head_dim,
        "block_size": cfg.block,
        "num_anchors": cfg.anchors,
        "loss_decay_gamma": cfg.gamma_,
        "torch_dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
        "drafter_config": dataclasses.asdict(cfg),
    }


def export(drafter: torch.nn.Module, directory: Path, target_layers: tuple[int, ...]) -> Path:
    """Writes `drafter` (a BlockDrafter, or one wrapped by DistributedDataParallel) to
    `directory` (replaced if it exists)."""
    from safetensors.torch import save_file

    drafter = getattr(drafter, "module", drafter)
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    state = {n: t.detach().cpu().contiguous() for n, t in drafter.state_dict().items()}
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config(drafter, target_layers), indent=1))
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def load(directory: Path, device: str | torch.device = "cpu") -> BlockDrafter:
    """The drafter `export` wrote to `directory`, on `device`, its embedding and head
    frozen as in training."""
    from safetensors.torch import load_file

    directory = Path(directory)
    meta = json.loads((directory / "config.json").read_text())
    if meta.get("architectures") != [ARCHITECTURE]:
        raise ValueError(
            f"expected a {ARCHITECTURE} directory, got architectures {meta.get('architectures')}"
        )
    fields = dict(meta["drafter_config"])
    cfg = DrafterConfig(**fields)
    with torch.device("meta"):
        shapes = TargetShapes(meta["hidden_size"], meta["target_hidden_size"], meta["vocab_size"])
        drafter = BlockDrafter(shapes, cfg)
    state = load_file(directory / "model.safetensors", device=str(device))
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter.embed.requires_grad_(False)
    drafter.lm_head.requires_grad_(False)
    return drafter
