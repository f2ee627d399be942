"""The HF bridge: streamed safetensors readers and writers, export (`to-hf`) and import (`from-hf`) of checkpoints,
the HF files carried in `CKPT/hf_assets/`. `python -m data_tools convert ...` is its command line."""
