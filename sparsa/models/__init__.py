"""Reference models for benchmarks and examples (no torchvision needed).

- :mod:`sparsa.models.convnets`: AlexNet-, VGG-16- (with/without BN) and ResNet-18-style convnets.
- :mod:`sparsa.models.minilm`: the pretrained MiniLM sentence encoder, loaded offline.
- :mod:`sparsa.models.causal_lm`: SmolLM2-135M (a pretrained Llama-architecture LM, offline; ``make
  llm-model``) and a tiny random Llama for tests.
"""
from .convnets import alexnet, vgg16, resnet18, BasicBlock, build  # noqa: F401
from .minilm import model_dir, load_minilm, tokenize, mean_pool, embed, encoder_linears  # noqa: F401
from .causal_lm import load_smollm2, tiny_llama  # noqa: F401
