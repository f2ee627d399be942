"""The dataset format the trainer reads and ``data_tools`` writes: Megatron's ``.bin``/``.idx`` pair
(`indexed`), ``PREFIX.meta.json`` (`metadata`) and the consistency check of both (`check`).

Free of torch/megatron imports, so ``python -m data_tools`` starts fast.
"""
