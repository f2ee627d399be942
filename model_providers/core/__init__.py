"""What every family shares: the `Family` base, HF mapping rules, layer specs and `GPTModel` building.

Family modules (`model_providers/<family>.py`) import from here; nothing here imports a family.
"""
