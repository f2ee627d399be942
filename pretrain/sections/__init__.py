"""Sections of the config tree that have grown into their own module (`pretrain/config.py` assembles the tree and
re-exports them). Each field is declared once, with its facts (`model_providers/core/knobs.py`: `knob`)."""
