"""Observability: the metrics record and its sinks, MoE routing, per-rank timing, FLOPs, profiling, the report."""
