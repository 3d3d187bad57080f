"""The stages a `Pipeline` schedules: the target's (target.py, target_graphs.py) and the
drafter's (drafter.py, drafter_graphs.py). A stage never imports the scheduler that runs it."""

from .drafter import DrafterStage, EagerDrafter
from .target import EagerTarget, GraphTarget, TargetStage

__all__ = ["DrafterStage", "EagerDrafter", "EagerTarget", "GraphTarget", "TargetStage"]
