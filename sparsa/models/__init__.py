"""Pretrained models the library's own features load (``sparsa prune``, :mod:`sparsa.frontier`, methods).

- :mod:`sparsa.models.minilm`: the pretrained MiniLM sentence encoder, loaded offline.
- :mod:`sparsa.models.causal_lm`: SmolLM2-135M (a pretrained Llama-architecture LM, offline; ``make
  llm-model``) and a tiny random Llama for tests.

The example convnets (AlexNet-, VGG-16-, ResNet-18-style) live in ``examples/convnets.py`` of the source
checkout, not in the package.
"""

from .minilm import model_dir, load_minilm, tokenize, mean_pool, embed, encoder_linears  # noqa: F401
from .causal_lm import load_smollm2, tiny_llama  # noqa: F401
