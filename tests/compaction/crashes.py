"""Crashing the compaction job at one of its checkpoints (`bus.compaction.CHECKPOINTS`).

In process: `run_compaction(..., checkpoint=crash_at("mid_delete"))`. As a
spark-submit run: submit this file instead of the job, with
`BUS_COMPACT_CRASH_AT=<point>`; it runs the job's own entry point with the
crash installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class CompactionCrash(Exception):
    """An injected crash: the run stops there, unfinished."""


def crash_at(point: str) -> Callable[[str], None]:
    """A checkpoint function that raises CompactionCrash at `point` (one of CHECKPOINTS)."""
    from bus.compaction import CHECKPOINTS

    assert point in CHECKPOINTS, f"{point!r} is not one of {CHECKPOINTS}"

    def checkpoint(reached: str) -> None:
        if reached == point:
            raise CompactionCrash(f"injected crash at {point}; run the job again to finish the run")

    return checkpoint


if __name__ == "__main__":  # spark-submit runs this file as a script: make the project importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bus.compaction import job

    job.exit_with(lambda: job.main(checkpoint=crash_at(os.environ["BUS_COMPACT_CRASH_AT"])))
