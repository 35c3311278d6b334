"""Model-level API: :func:`sparsify` (apply :class:`Rule` s to a model) and :func:`densify` (undo).

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
from typing import Dict, Iterable, List, Sequence, Tuple, Union

import torch
from torch import nn

from ..sparsifiers.base import Sparsifier
from ..tensor import SparseTensor, to_sparse
from .hooks import GradLayout, OutputSparsifier
from .rule import Rule

__all__ = ["sparsify", "densify"]

Rules = Union[Rule, Sparsifier, Sequence[Rule]]


def _as_rules(rules: Rules) -> List[Rule]:
    if isinstance(rules, Sparsifier):
        return [Rule(sparsifier=rules, module_types=(nn.Linear,))]
    if isinstance(rules, Rule):
        return [rules]
    if isinstance(rules, (list, tuple)) and rules and all(isinstance(r, Rule) for r in rules):
        return list(rules)
    raise TypeError("rules must be a sparsa.Rule, a list of Rules, or a Sparsifier (shorthand for "
                    f"Rule(sparsifier=s, module_types=nn.Linear)); got {rules!r}")


def _assign(model: nn.Module, rules: List[Rule], target: str) -> Dict[int, List[Tuple[str, nn.Module]]]:
    """For ``target``, the first matching rule per tensor. Returns rule index -> [(name, module)]."""
    out: Dict[int, List[Tuple[str, nn.Module]]] = {}
    for name, mod in model.named_modules():
        for i, r in enumerate(rules):
            if r.target != target or not r.matches(name, mod):
                continue
            if target != "output" and mod._parameters.get(r.param) is None:
                continue
            out.setdefault(i, []).append((name, mod))
            break
    return out


def _no_match_error(model: nn.Module, rule: Rule, shadowed: bool) -> ValueError:
    avail = [f"{n or '<root>'} ({type(m).__name__}{', ' + ','.join(m._parameters) if m._parameters else ''})"
             for n, m in model.named_modules()]
    shown = ", ".join(avail[:40]) + (f", ... ({len(avail) - 40} more)" if len(avail) > 40 else "")
    why = ("every tensor it matches is already claimed by an earlier rule (the first matching rule wins)"
           if shadowed else "it matches no module" + (f" with a parameter {rule.param!r}"
                                                       if rule.target != "output" else ""))
    return ValueError(f"sparsa.sparsify: {rule.describe()} does nothing: {why}. Fix its names/module_types. "
                      f"Modules (parameters): {shown}")


def sparsify(model: nn.Module, rules: Rules, *, inplace: bool = True, report: bool = False):
    """Apply ``rules`` to ``model``; returns the model (and the :func:`sparsity_report` rows if ``report``).

    For every tensor the first matching rule wins. A rule that matches nothing raises ``ValueError``
    listing the model's modules (pruning that silently does nothing is a bug). ``rules`` may be one
    :class:`Rule`, a list, or a bare :class:`~sparsa.sparsifiers.Sparsifier` (shorthand for all
    ``nn.Linear`` weights in the masked layout). Tied parameters stay tied. ``inplace=False`` works
    on a deep copy.

    * ``target="weight"``: ``module.<param>`` becomes ``nn.Parameter(SparseTensor)``; optimizer
      steps (SGD, Adam, AdamW...) keep its pattern (or re-apply ``inline``).
    * ``target="output"``: a forward hook stores the module's output in the layout.
    * ``target="grad"``: after backward, the sparse parameter's ``.grad`` is stored in the layout
      (restricted to the parameter's pattern). Apply weight rules first (same call is fine).
    """
    rule_list = _as_rules(rules)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not inplace:
        model = copy.deepcopy(model)
    # check every rule does something before touching the model
    assigned = {t: _assign(model, rule_list, t) for t in ("weight", "grad", "output")}
    for i, r in enumerate(rule_list):
        if i not in assigned[r.target]:
            alone = _assign(model, [r], r.target)
            raise _no_match_error(model, r, shadowed=bool(alone))
    for i, r in enumerate(rule_list):
        if r.target == "grad":
            for name, mod in assigned["grad"][i]:
                p = mod._parameters[r.param]
                pending_weight = any(mod is m for j, lst in assigned["weight"].items() for _, m in lst
                                     if rule_list[j].param == r.param)
                if not isinstance(p, SparseTensor) and not pending_weight:
                    raise ValueError(f"sparsa.sparsify: grad rule for {name}.{r.param}: the parameter is dense; "
                                     "add a target='weight' rule that sparsifies it (a sparse gradient is "
                                     "restricted to the weight's pattern)")
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
    if report:
        from .report import sparsity_report
        return model, sparsity_report(model)
    return model


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
    return model


def sparse_parameters(model: nn.Module) -> Iterable[Tuple[str, SparseTensor]]:
    """``(name, parameter)`` for every sparse parameter of ``model``."""
    for name, p in model.named_parameters():
        if isinstance(p, SparseTensor):
            yield name, p


