"""Megatron-Core distributed checkpoints (`torch_dist`) under `run.dir/checkpoints/`.

- `format`: file names, the tracker, the commit, the safe readers (also used by the HF bridge);
- `state`: what a checkpoint holds (sharded model/optimizer state, step, config, RNG);
- `save`: synchronous and asynchronous saves, the commit, pruning, the writer helper;
- `load`: checks before loading, and loading;
- `resume`: which checkpoint a run resumes from (and finishing a commit a kill interrupted);
- `contract`: the resume contract, what a resumed run may change (every config field has a class);
- `optimizer_forms`: loading optimizer state written by the other optimizer (`optimizer.distributed` toggled).
"""
