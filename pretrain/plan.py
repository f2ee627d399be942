"""`python -m pretrain plan ...` (the CLI) and the planner's names, kept importable as `pretrain.plan`.

The planner itself lives in the `pretrain.planner` package, split by concern.
"""

from pretrain.planner import *  # noqa: F403
from pretrain.planner import __all__ as _planner_names
from pretrain.planner.cli import build_parser, main

__all__ = [*_planner_names, "build_parser", "main"]
