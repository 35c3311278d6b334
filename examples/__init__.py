"""Examples built on sparsa; not part of the installed ``sparsa`` package (the wheel ships ``sparsa*`` only).

- :mod:`examples.flagship`: the flagship demo (``make demo``; ``python -m examples.flagship --help``).
- :mod:`examples.demo`: a small demo, an MLP on scikit-learn's digits (``python -m examples.demo``).
- :mod:`examples.convnets`: AlexNet-, VGG-16- and ResNet-18-style convnets for the demo, benchmarks and tests.

Run them from the repository root (``python -m examples.<name>``); they need the ``demo`` extra
(``pip install -e ".[demo]"``).
"""
