"""What a training run reports: the loss curve, a CSV of the logged steps and, when
`tensorboard` is installed and asked for, the same scalars for TensorBoard; and the
--check comparison and the drafter's checksum."""

from __future__ import annotations

import csv
import hashlib
import resource
import sys
from pathlib import Path
from typing import Any

import torch

BF16_RTOL = 2e-2  # losses of two bf16 runs: a few bf16 ulps (2^-8) of drift over the steps
FP32_RTOL = 1e-4  # float32 on CPU, padded against unpadded: rounding over the steps
FIELDS = ("step", "loss", "lr", "samples_per_s", "tokens_per_s", "memory_bytes")


def memory_bytes(device: str) -> int:
    """The drafter device's peak: the CUDA allocator's, or this process's peak RSS."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class Scalars:
    """Writes each logged step's scalars (FIELDS) to `out/metrics.csv`, beside the loss
    curve, and with `tensorboard` to a SummaryWriter in `out/tensorboard` when the
    `tensorboard` package is importable (else a warning, and the CSV alone). A resumed
    run appends to the CSV."""

    def __init__(self, out: Path, *, tensorboard: bool, append: bool) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "metrics.csv"
        fresh = not (append and self.path.exists())
        self._file = self.path.open("w" if fresh else "a", newline="")
        self._csv = csv.DictWriter(self._file, FIELDS)
        if fresh:
            self._csv.writeheader()
        self.writer: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print(
                    "tensorboard is not installed (pip install tensorboard): "
                    f"the scalars go to {self.path} only",
                    file=sys.stderr,
                )
            else:
                self.writer = SummaryWriter(str(out / "tensorboard"))

    def add(self, row: dict[str, float]) -> None:
        self._csv.writerow(row)
        self._file.flush()
        if self.writer is not None:
            for name in FIELDS[1:]:
                self.writer.add_scalar(f"train/{name}", row[name], int(row["step"]))

    def close(self) -> None:
        self._file.close()
        if self.writer is not None:
            self.writer.close()


def plot(curves: dict[str, list[float]], path: Path, first_step: int = 1) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed: no loss curve (pip install matplotlib)", file=sys.stderr
        )
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in curves.items():
        ax.plot(range(first_step, first_step + len(values)), values, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("drafter loss")
    ax.set_title("DFlash-style drafter, online training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def compare(
    reference: list[list[float]],
    other: list[list[float]],
    mode: str,
    exact: bool,
    rtol: float = BF16_RTOL,
) -> tuple[bool, str]:
    """Whether `mode`'s losses per step match the sequential loop's, and a line saying so."""
    a = [x for step in reference for x in step]
    b = [x for step in other for x in step]
    if exact:
        ok = a == b
        verb = "equal" if ok else "differ from"
        return ok, f"{mode} losses {verb} the sequential loop's exactly"
    worst = max(abs(x - y) / max(abs(x), 1e-6) for x, y in zip(a, b, strict=False))
    ok = len(a) == len(b) and worst <= rtol
    kind = "bf16" if rtol == BF16_RTOL else "float32"
    return ok, (
        f"{mode} losses vs the sequential loop: max relative difference {worst:.2e} "
        f"({'within' if ok else 'beyond'} the {kind} tolerance {rtol:.0e})"
    )


def checksum(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name, tensor in state.items():
        digest.update(name.encode())
        digest.update(tensor.float().numpy().tobytes())
    return digest.hexdigest()
