"""User tools: preprocess, inspect, verify, merge, convert (CLI: ``python -m data_tools``)."""

import os

os.environ.setdefault("NO_VCS_VERSION", "1")  # megatron-core's plain version (see pretrain/__init__.py)
