"""The pipeline: `Pipeline` (scheduler.py) runs microbatches through a target stage and
drafter stages on lanes.

- scheduler.py: `Pipeline`: set-up, `run`, the submits, `stats`.
- _flight.py: microbatches in flight and the prefetch window; _failures.py: which stage
  failed and what is still outstanding; step_result.py: `StepResult`.
- native_microbatch.py: a microbatch as one native stream program.
- stages/: the target's and the drafter's stages, eager and graphed.

Arrows point down: the scheduler imports the stages, a stage never imports the scheduler.
"""

from .scheduler import Pipeline
from .step_result import StepResult

__all__ = ["Pipeline", "StepResult"]
