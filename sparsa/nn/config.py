"""The base class of the method configs :func:`sparsa.sparsify` takes besides rules and sparsifiers.

A config states a whole method (one-shot magnitude, gradual, Wanda, SparseGPT: see
:mod:`sparsa.methods`) and its data; ``sparsify(model, config, filter_fn)`` runs it in place and
returns the model, so every way to sparsify is one call with one return type.

>>> import torch.nn as nn, sparsa
>>> class HalfOfFirst(SparsifyConfig):
...     def apply(self, model, filter_fn=None):
...         first = next(n for n, m in model.named_modules() if isinstance(m, nn.Linear))
...         sparsa.sparsify(model, sparsa.Rule(sparsifier=sparsa.sparsifiers.Magnitude(0.5), names=first))
>>> model = sparsa.sparsify(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), HalfOfFirst())
>>> model[0].weight.layout_name, type(model[1].weight).__name__
('masked', 'Parameter')
"""

from __future__ import annotations

from typing import Callable, List, Optional

from torch import nn

__all__ = ["SparsifyConfig", "FilterFn", "selected_linears"]

#: ``filter_fn(module, name) -> bool``: which modules a config may touch (torchao's convention)
FilterFn = Callable[[nn.Module, str], bool]


class SparsifyConfig:
    """A sparsification method with its settings; subclasses implement :meth:`apply`."""

    def apply(self, model: nn.Module, filter_fn: Optional[FilterFn] = None) -> None:
        """Sparsify ``model`` in place, only the modules ``filter_fn(module, name)`` accepts (all the
        method's default modules when None)."""
        raise NotImplementedError(f"{type(self).__name__} must implement apply(model, filter_fn)")


def selected_linears(model: nn.Module, filter_fn: Optional[FilterFn]) -> Optional[List[str]]:
    """The full names of the ``nn.Linear`` modules ``filter_fn`` accepts (``None`` when no filter: the
    method's own default); ``ValueError`` if it accepts none, since pruning nothing is a bug.

    >>> m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> selected_linears(m, lambda mod, name: name == "2")
    ['2']
    """
    if filter_fn is None:
        return None
    if not callable(filter_fn):
        raise TypeError(f"filter_fn must be a callable filter_fn(module, name) -> bool or None, got {filter_fn!r}")
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and filter_fn(m, n)]
    if not names:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        raise ValueError(
            f"filter_fn accepts none of the model's nn.Linear modules ({', '.join(linears[:20]) or 'none'}"
            f"{', ...' if len(linears) > 20 else ''}); fix it so it returns True for the layers to prune"
        )
    return names
