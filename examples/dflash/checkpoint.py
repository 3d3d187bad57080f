"""Checkpoints to resume a run: the drafter, its optimizer and LR scheduler, the data
position and the RNG states, written atomically.

Note [Resume]: a checkpoint is taken between optimizer steps with every lane idle: at the
end of a segment of `--checkpoint-every` steps (the loop runs segment by segment, each a
complete run of the pipeline over its microbatches), or after Ctrl-C, once the loop has
closed. Then the weights, the optimizer's state and the scheduler's are those of the same
completed step: the scheduler's count says which (`completed_steps`), and gradients
accumulated for an unfinished step are dropped. The data position is that step times the
microbatches per step: microbatch i of the run is a pure function of (seed, i), so a
resumed run reads the same microbatches the interrupted one would have. Under DDP every
rank holds the same drafter; rank 0 writes. The file is written beside its final name
and moved over it with os.replace: a crash while writing leaves the previous checkpoint.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

FORMAT = 1


def completed_steps(schedulers: list[Any]) -> int:
    """Optimizer steps the run has taken: the first scheduler's count (it steps right
    after each optimizer step, in the same task)."""
    return int(schedulers[0].last_epoch)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "module", module)  # DistributedDataParallel


def trainable_state(drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The drafter's trained weights (its embedding and head are the target's, frozen)."""
    module = _unwrap(drafter)
    return {n: p.detach().cpu() for n, p in module.named_parameters() if p.requires_grad}


def save(path: Path, models: Any, step: int, run: dict[str, Any]) -> None:
    """Writes the checkpoint of `models` after `step` optimizer steps, atomically.
    `run` identifies the run (configuration, data, world size): a resume checks it."""
    state = {
        "format": FORMAT,
        "step": step,
        "run": run,
        "drafter": trainable_state(models.drafters[0]),
        "optimizer": _plain_hyperparameters(models.optimizers[0].state_dict()),
        "scheduler": models.schedulers[0].state_dict(),
        "rng": rng_state(),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _plain_hyperparameters(state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's state with one-element tensor hyperparameters as numbers: a graph
    stage (DrafterGraphs) keeps `lr` as a device tensor of its own, which a resumed run's
    stage makes again."""
    for group in state["param_groups"]:
        for key, value in group.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                group[key] = value.item()
    return state


class ResumeError(ValueError):
    """A checkpoint that does not belong to this run."""


def load(path: Path, run: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint at `path`, checked against this run's `run`."""
    path = Path(path)
    if not path.is_file():
        raise ResumeError(f"{path}: no checkpoint there")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to replace
        raise ResumeError(f"{path}: not a checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ResumeError(f"{path}: expected a checkpoint of format {FORMAT}")
    changed = sorted(
        k for k in run.keys() | state["run"].keys() if run.get(k) != state["run"].get(k)
    )
    if changed:
        theirs = {k: state["run"].get(k) for k in changed}
        ours = {k: run.get(k) for k in changed}
        raise ResumeError(f"{path} is another run's: expected {ours}, got {theirs}")
    return state


def restore(state: dict[str, Any], models: Any) -> int:
    """Loads `state` into every drafter replica, optimizer and scheduler and sets the RNG
    states; returns the completed steps."""
    for drafter, optimizer, scheduler in zip(
        models.drafters, models.optimizers, models.schedulers, strict=True
    ):
        module = _unwrap(drafter)
        missing = [
            n for n, p in module.named_parameters() if p.requires_grad and n not in state["drafter"]
        ]
        if missing:
            raise ResumeError(f"the checkpoint lacks drafter weights {missing}")
        with torch.no_grad():
            for name, p in module.named_parameters():
                if p.requires_grad:
                    p.copy_(state["drafter"][name])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return int(state["step"])
