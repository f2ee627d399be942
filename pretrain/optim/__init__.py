"""Optimizers other than Megatron-Core's default Adam(W): Muon (`optimizer.name: muon`)."""
