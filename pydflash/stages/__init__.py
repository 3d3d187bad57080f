"""The stages a `Pipeline` schedules. A stage never imports the scheduler that runs it."""

from .target import EagerTarget, GraphTarget, TargetStage

__all__ = ["EagerTarget", "GraphTarget", "TargetStage"]
