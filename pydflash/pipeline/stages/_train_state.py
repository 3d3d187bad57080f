"""What a captured training step needs of the trained model and its optimizer: gradients
in static buffers, an optimizer whose hyperparameters a graph reads from tensors, and the
`lengths` input of Note [Padding contract] (pydflash/pipeline/stages/drafter_graphs.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def flat_gradients(
    params: Sequence[torch.nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One zeroed flat buffer per (dtype, device) of `params`, and each parameter's
    gradient as a view into it, installed as its `.grad` (Note [Static gradients])."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.dtype, p.device), []).append(i)
    flats: list[torch.Tensor] = []
    views: list[Any] = [None] * len(params)
    for (dtype, device), members in groups.items():
        flat = torch.zeros(sum(params[i].numel() for i in members), dtype=dtype, device=device)
        offset = 0
        for i in members:
            n = params[i].numel()
            views[i] = flat[offset : offset + n].view(params[i].shape)
            params[i].grad = views[i]
            offset += n
        flats.append(flat)
    return flats, views


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> list:
    """Note [Capturable optimizers]: sets `capturable=True` in every param group that has
    the option, fused ones included (torch's fused Adam and AdamW take it: their steps
    already live on the device, and a tensor `lr` on the device is read there), with `lr`
    as a one-element float32 tensor on `device`, and the optimizer's existing state moved
    where torch's own `load_state_dict` puts it for a capturable group: scalar state
    (`step`, ASGD's `eta` and `mu`, NAdam's `mu_product`) on the parameter's device,
    `step` as float32. Returns (group, "lr", tensor) for each such group.

    The stage runs the first step eagerly on purpose (it creates the state outside any
    graph), so torch's one warning that a capturable optimizer ran uncaptured is marked
    as given."""
    made = []
    for group in optimizer.param_groups:
        if "capturable" not in group:
            continue
        group["capturable"] = True
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.device != p.device:
                    state[key] = value.to(p.device, torch.float32 if key == "step" else None)
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        elif group["lr"].device != device:  # a graph would bake in a host tensor's value
            group["lr"] = group["lr"].to(device)
        made.append((group, "lr", group["lr"]))
    if made:
        # torch.optim.Optimizer's _accelerator_graph_capture_health_check warns once per
        # optimizer, keyed by this attribute, when a capturable step runs uncaptured.
        optimizer._warned_capturable_if_run_uncaptured = True  # type: ignore[attr-defined]
    return made


def host_state(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """What of the optimizer's state a captured step could not keep up to date, or None:
    a replay runs only GPU work, so state on the host (a Python number, a CPU tensor such
    as a step count of an optimizer without `capturable`) would stay as captured, and a
    group whose `capturable` is False refuses capture. Read after the first step, once
    the state exists."""
    for group in optimizer.param_groups:
        if group.get("capturable") is False:
            return f"a param group of {type(optimizer).__name__} has capturable=False"
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if not _same_device(value.device, device):
                    return (
                        f"{type(optimizer).__name__} keeps state[{key!r}] on {value.device}, "
                        f"not on {device}"
                    )
            elif value is not None:
                return (
                    f"{type(optimizer).__name__} keeps state[{key!r}] on the host "
                    f"({type(value).__name__})"
                )
    return None


def _same_device(have: torch.device, want: torch.device) -> bool:
    return have.type == want.type and (want.index is None or have.index in (None, want.index))


def restore_tensor_hypers(tensor_hypers: list) -> None:
    """A tensor hyperparameter replaced by a number (by a scheduler that assigns, or by
    the user) has the number written into the tensor the step graph reads, and is put
    back in its group."""
    for group, key, tensor in tensor_hypers:
        value = group[key]
        if value is not tensor:
            tensor.fill_(float(value))
            group[key] = tensor


def plain_hypers(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The hyperparameters of each param group that a capture bakes in: all but tensors."""
    return [
        {k: v for k, v in group.items() if k != "params" and _plain(v)}
        for group in optimizer.param_groups
    ]


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, (bool, int, float, str, type(None)))


def lengths_tensor(rows: int, b: int, t: int, leaves: Sequence[Any]) -> torch.Tensor:
    """[rows] int64 on the device of the first tensor in `leaves`: t for the first b rows,
    0 after (Note [Padding contract])."""
    device = next(x.device for x in leaves if isinstance(x, torch.Tensor))
    lengths = torch.empty(rows, dtype=torch.long, device=device)
    set_lengths(lengths, b, t)
    return lengths


def set_lengths(lengths: torch.Tensor, b: int, t: int) -> None:
    lengths[:b].fill_(t)
    if b < lengths.shape[0]:
        lengths[b:].fill_(0)


def all_reduce_mean(flats: list[torch.Tensor], group: Any) -> None:
    """Each flat buffer averaged over the process group (as DistributedDataParallel)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    for flat in flats:
        dist.all_reduce(flat, group=group)
        flat.div_(world)
