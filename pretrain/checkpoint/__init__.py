"""Megatron-Core distributed checkpoints (`torch_dist`) under `run.dir/checkpoints/`.

- `format`: file names, the tracker, the commit, the safe readers (also used by the HF bridge);
- `context`: `CheckpointContext`, what save/load/resume act on (model chunks, optimizer, schedule, plan, pieces);
- `stateful`: the pieces a checkpoint holds as `Stateful` objects, each owning its save and load rule;
- `state`: the model's sharded state, the RNG states, `RUN_STATE` (other parts' run-level state);
- `save`: synchronous and asynchronous saves, the commit, pruning, the writer helper;
- `load`: loading (the format's backend checks before it reads);
- `backends`: the formats behind one interface (`torch_dist`, `fsdp_format`, `cross_format`), picked once by
  `save` and `load`;
- `resume`: which checkpoint a run resumes from (and finishing a commit a kill interrupted);
- `contract`: the resume contract, what a resumed run may change (every config field has a class);
- `optimizer_forms`: loading optimizer state written by the other optimizer (`optimizer.distributed` toggled).
"""
