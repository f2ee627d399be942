"""Faults a long run meets, handled: results validated by Megatron-Core's `RerunStateMachine` (NaN/Inf/spiky
loss re-run, verdict transient or persistent), known-bad steps skipped, hangs caught by a per-rank watchdog,
stragglers named, and the faults injected on purpose by tests (`testing.*`).

`faults` (injection), `results` (the rerun state machine around a step),
`skips` (train.skip_steps), `watchdog` (hangs), `stragglers`, `hooks` (what train.py calls).
"""
