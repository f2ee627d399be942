"""The rank pools' report of a rank that dies natively (`tests/pool`): the rank's Python stack (faulthandler) and what
the launcher says go into the case's log, where the FSDP launches' rerun rule (`fsdp_cases.NATIVE_FLAKES`) reads it."""

from __future__ import annotations

import os
import signal
import sys

import pytest

pytestmark = pytest.mark.slow


def main(argv: list[str]) -> int:
    """A pool case: rank `argv[0]` dies by SIGSEGV (as a native crash does), the others wait for it."""
    import torch.distributed as dist

    if dist.get_rank() == int(argv[0]):
        print("rank about to crash", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return 0


def test_a_rank_killed_by_a_signal_is_named_in_the_case_log(tmp_path):
    from tests.pool import run_case
    from tests.pretrain.ckpt_helpers import log_text
    from tests.pretrain.fsdp_cases import NATIVE_FLAKES

    log = tmp_path / "case.log"
    try:
        rc = run_case(2, __name__, ["1"], log, timeout=120)
    except AssertionError:  # the pool died before the other rank reported: a failure all the same
        rc = 1
    text = log_text(log)
    assert rc != 0, text
    assert "rank about to crash" in text
    # The rank's own Python stack at the crash (faulthandler, enabled by the pool's server).
    assert "Fatal Python error: Segmentation fault" in text and 'test_rank_pool.py", line' in text, text[-3000:]
    # torchrun says how the rank ended; the rank could not. Before the report, the log ended at the other rank's
    # "Connection closed by peer" and the crash was not recognised as one.
    assert "[pool] the rank pool's launcher printed during this case:" in text, text[-3000:]
    found = NATIVE_FLAKES.search(text)
    assert found is not None and found.group(0).startswith("Signal 11 (SIGSEGV) received by PID"), text[-3000:]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
