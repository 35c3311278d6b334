"""Model-level API: :func:`sparsify` (the one way to make a model sparse) and :func:`densify` (undo).

>>> import torch, torch.nn as nn, sparsa
>>> from sparsa.sparsifiers import Magnitude
>>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
>>> model = sparsa.sparsify(model, sparsa.Rule(sparsifier=Magnitude(0.75), module_types=nn.Linear))
>>> round(model[0].weight.sparsity, 2), model[0].weight.layout_name
(0.75, 'masked')
>>> y = model(torch.randn(2, 16))             # runs through sparsa's dispatcher
>>> model = sparsa.densify(model)             # plain dense parameters again
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..sparsifiers.base import Sparsifier, is_sparsifier
from ..tensor import SparseTensor, to_sparse
from .config import FilterFn, SparsifyConfig
from .hooks import GradLayout, OutputSparsifier
from .report import PATH_ATTR, sparsity_report
from .rule import Rule

__all__ = ["sparsify", "densify"]

Rules = Union[Rule, Sparsifier, Sequence[Rule]]
Config = Union[SparsifyConfig, Rule, Sparsifier, Sequence[Rule], Any]


def _as_rules(rules: Rules) -> List[Rule]:
    if isinstance(rules, Rule):
        return [rules]
    if isinstance(rules, (list, tuple)) and rules and all(isinstance(r, Rule) for r in rules):
        return list(rules)
    if is_sparsifier(rules):
        return [Rule(sparsifier=rules, module_types=(nn.Linear,))]
    raise TypeError(
        "config must be a method config (e.g. sparsa.methods.OneShot(0.5, pattern='2:4')), a "
        "sparsa.Rule, a non-empty list of rules, or a sparsifier (a sparsa.sparsifiers.Sparsifier or any "
        "object with a mask(dense) -> bool tensor method; shorthand for Rule(sparsifier=s, "
        f"module_types=nn.Linear)); got {type(rules).__name__} {rules!r}"
    )


def _assign(
    model: nn.Module, rules: List[Rule], target: str, filter_fn: Optional[FilterFn] = None
) -> Dict[int, List[Tuple[str, nn.Module]]]:
    """For ``target``, the first matching rule per tensor among the modules ``filter_fn`` accepts.
    Returns rule index -> [(name, module)]."""
    out: Dict[int, List[Tuple[str, nn.Module]]] = {}
    for name, mod in model.named_modules():
        if filter_fn is not None and not filter_fn(mod, name):
            continue
        for i, r in enumerate(rules):
            if r.target != target or not r.matches(name, mod):
                continue
            if target != "output" and mod._parameters.get(r.param) is None:
                continue
            out.setdefault(i, []).append((name, mod))
            break
    return out


def _no_match_error(model: nn.Module, rule: Rule, shadowed: bool, filtered: bool = False) -> ValueError:
    avail = [
        f"{n or '<root>'} ({type(m).__name__}{', ' + ','.join(m._parameters) if m._parameters else ''})"
        for n, m in model.named_modules()
    ]
    shown = ", ".join(avail[:40]) + (f", ... ({len(avail) - 40} more)" if len(avail) > 40 else "")
    why = (
        "every tensor it matches is already claimed by an earlier rule (the first matching rule wins)"
        if shadowed
        else "it matches no module"
        + (f" with a parameter {rule.param!r}" if rule.target != "output" else "")
        + (" that filter_fn accepts" if filtered else "")
    )
    return ValueError(
        f"sparsa.sparsify: {rule.describe()} does nothing: {why}. Fix its names/module_types. "
        f"Modules (parameters): {shown}"
    )


def sparsify(
    model: nn.Module,
    config: Config,
    filter_fn: Optional[FilterFn] = None,
    *,
    inplace: bool = True,
    report: bool = False,
) -> nn.Module:
    """Sparsify ``model`` with ``config``; returns the model. The one way to sparsify: reports come from
    :func:`sparsity_report`, methods are configs.

    ``config`` is one of:

    * a method config from :mod:`sparsa.methods`: :class:`~sparsa.methods.OneShot` (magnitude, any
      pattern or layout, optionally only where faster), :class:`~sparsa.methods.Gradual`,
      :class:`~sparsa.methods.Wanda`, :class:`~sparsa.methods.SparseGPT` (the last two carry their
      calibration batches);
    * a :class:`Rule` or a list of them (weights, outputs or gradients of any module);
    * a sparsifier: a :class:`~sparsa.sparsifiers.Sparsifier` or any object with a
      ``mask(dense) -> bool tensor`` method (shorthand for all ``nn.Linear`` weights in the masked layout).

    ``filter_fn(module, name) -> bool`` restricts which modules are touched (e.g.
    ``lambda m, n: not n.startswith("lm_head")``). A rule (or filter) that matches nothing raises
    ``ValueError`` listing the model's modules: pruning that silently does nothing is a bug. For every
    tensor the first matching rule wins; tied parameters stay tied. ``inplace=False`` works on a deep copy.

    * ``target="weight"``: ``module.<param>`` becomes ``nn.Parameter(SparseTensor)``; optimizer
      steps (SGD, Adam, AdamW...) keep its pattern (or re-apply ``inline``).
    * ``target="output"``: a forward hook stores the module's output in the layout.
    * ``target="grad"``: after backward, the sparse parameter's ``.grad`` is stored in the layout
      (restricted to the parameter's pattern). Apply weight rules first (same call is fine).

    ``report=True`` is deprecated: it still returns ``(model, sparsity_report(model))``.

    >>> import torch.nn as nn, sparsa
    >>> from sparsa.methods import OneShot
    >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    >>> model = sparsa.sparsify(model, OneShot(pattern="2:4"), filter_fn=lambda m, name: name == "0")
    >>> model[0].weight.layout_name, type(model[2].weight).__name__
    ('nm', 'Parameter')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be a callable filter_fn(module, name) -> bool or None, got {filter_fn!r}")
    if not isinstance(config, SparsifyConfig):
        rule_list = _as_rules(config)
    if not inplace:
        model = copy.deepcopy(model)
    if isinstance(config, SparsifyConfig):
        config.apply(model, filter_fn)
    else:
        _apply_rules(model, rule_list, filter_fn)
    if report:
        warnings.warn(
            "sparsa.sparsify(..., report=True) is deprecated: call model = sparsa.sparsify(model, config) "
            "and then rows = sparsa.sparsity_report(model)",
            DeprecationWarning,
            stacklevel=2,
        )
        return model, sparsity_report(model)
    return model


def _apply_rules(model: nn.Module, rule_list: List[Rule], filter_fn: Optional[FilterFn]) -> None:
    # check every rule does something before touching the model
    assigned = {t: _assign(model, rule_list, t, filter_fn) for t in ("weight", "grad", "output")}
    for i, r in enumerate(rule_list):
        if i not in assigned[r.target]:
            alone = _assign(model, [r], r.target, filter_fn)
            raise _no_match_error(model, r, shadowed=bool(alone), filtered=filter_fn is not None)
    for i, r in enumerate(rule_list):
        if r.target == "grad":
            for name, mod in assigned["grad"][i]:
                p = mod._parameters[r.param]
                pending_weight = any(
                    mod is m for j, lst in assigned["weight"].items() for _, m in lst if rule_list[j].param == r.param
                )
                if not isinstance(p, SparseTensor) and not pending_weight:
                    raise ValueError(
                        f"sparsa.sparsify: grad rule for {name}.{r.param}: the parameter is dense; "
                        "add a target='weight' rule that sparsifies it (a sparse gradient is "
                        "restricted to the weight's pattern)"
                    )
    memo: Dict[int, nn.Parameter] = {}
    for i, lst in assigned["weight"].items():
        for name, mod in lst:
            _sparsify_param(mod, rule_list[i], memo)
    for i, lst in assigned["grad"].items():
        r = rule_list[i]
        for name, mod in lst:
            p = mod._parameters[r.param]
            p.register_post_accumulate_grad_hook(GradLayout(r.layout, r.resolved_layout_params()))
    for i, lst in assigned["output"].items():
        r = rule_list[i]
        for name, mod in lst:
            _remove_output_hooks(mod)
            mod.register_forward_hook(OutputSparsifier(r.layout, r.sparsifier, r.resolved_layout_params()))


def _sparsify_param(mod: nn.Module, rule: Rule, memo: Dict[int, nn.Parameter]) -> None:
    old = mod._parameters[rule.param]
    if id(old) in memo:  # tied weight: reuse the one sparse parameter
        setattr(mod, rule.param, memo[id(old)])
        return
    with torch.no_grad():
        if isinstance(old, SparseTensor):
            dense = old.sparse_layout.to_dense()
            mask = old.pattern() if rule.sparsifier is None else None
        else:
            dense, mask = old.detach(), None
        sp = to_sparse(dense, rule.layout, mask=mask, sparsifier=rule.sparsifier, **rule.resolved_layout_params())
    new = nn.Parameter(sp, requires_grad=old.requires_grad)
    new.inline_sparsifier = rule.inline_sparsifier()
    memo[id(old)] = new
    setattr(mod, rule.param, new)


def _remove_output_hooks(mod: nn.Module) -> None:
    for k in [k for k, h in mod._forward_hooks.items() if isinstance(h, OutputSparsifier)]:
        del mod._forward_hooks[k]


def densify(model: nn.Module, *, inplace: bool = True) -> nn.Module:
    """Turn every sparse parameter/buffer back into a plain dense one and remove sparsa's output hooks.

    Gradient-layout hooks go away with the sparse parameters. Tied parameters stay tied.
    """
    if not inplace:
        model = copy.deepcopy(model)
    memo: Dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if isinstance(p, SparseTensor):
                if id(p) not in memo:
                    dense = p.sparse_layout.to_dense().detach().clone()
                    memo[id(p)] = nn.Parameter(dense, requires_grad=p.requires_grad)
                setattr(mod, pname, memo[id(p)])
        for bname, b in list(mod._buffers.items()):
            if isinstance(b, SparseTensor):
                mod._buffers[bname] = b.sparse_layout.to_dense().detach().clone()
        _remove_output_hooks(mod)
        mod.__dict__.pop(PATH_ATTR, None)
    return model


def sparse_parameters(model: nn.Module) -> Iterable[Tuple[str, SparseTensor]]:
    """``(name, parameter)`` for every sparse parameter of ``model``."""
    for name, p in model.named_parameters():
        if isinstance(p, SparseTensor):
            yield name, p
