"""Failures every rank of a launch meets with the same words are said once, by rank 0.

A rank of a torchrun launch that does not say it waits a bounded while before it exits (`let_rank0_say_it`): torchrun
stops every process of the launch as soon as one exits non-zero, so a rank 1 that returned at once could stop rank 0
before it had printed why (the config error of `torchrun --nproc-per-node 2 -m pretrain train` went unsaid that
way). Rank 0 exits as soon as it has said it, and torchrun then stops the waiting ranks (SIGTERM, back to its default
action for the wait: the trainer's stop handler would only record it): the wait costs nothing unless rank 0 is gone.
"""

from __future__ import annotations

import os
import signal
import threading
import time

LINGER_S = 60.0  # the most a silent rank waits for rank 0 to say the failure


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def let_rank0_say_it(seconds: float = LINGER_S) -> None:
    """On a rank other than 0 of a torchrun launch (its agent sets TORCHELASTIC_RUN_ID) of several processes: wait up
    to `seconds` before returning; SIGTERM ends the wait (and the process) at once. Elsewhere (one process, srun's
    tasks, the test pools) nothing stops rank 0 early: no wait."""
    if rank() == 0 or int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(seconds)
