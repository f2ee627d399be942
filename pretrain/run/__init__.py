"""The run's process: runtime and process groups, set-up before the first step, the run directory, the output
lock, child processes."""
