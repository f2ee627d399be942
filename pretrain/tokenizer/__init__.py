"""Which tokenizer: type names and aliases (`types`), user arguments resolved to files (`spec`), the
reference libraries (`libraries`), the Megatron-Core tokenizer the trainer uses (`load`, `megatron_text`),
a tokenizer's identity (`identity`) and the embedded tokenizer files (`embedded`).

``data_tools`` builds its fast batch encoders for ``preprocess`` on top of these.
"""

from pretrain.tokenizer.load import load_tokenizer
from pretrain.tokenizer.spec import TokenizerSpec, resolve_spec
from pretrain.tokenizer.types import TOKENIZER_TYPES, TokenizerError

__all__ = ["TOKENIZER_TYPES", "TokenizerError", "TokenizerSpec", "load_tokenizer", "resolve_spec"]
