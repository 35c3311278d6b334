"""Save and load sparse models: compressed, atomic, and safe (safetensors only, never pickle).

Sparse tensors are written as their layout components (``<key>::<component>``) with the layout
name, parameters, logical shape and dtype in the file's JSON metadata; dense tensors as they are.
Integer index components are stored in the smallest integer dtype that holds them (e.g. CSR column
indices of a 256-wide matrix as uint8) and restored to their original dtype on load.
Every tensor carries a BLAKE2 digest, so a corrupted file is reported instead of loaded.

Example::

    >>> import os, tempfile, torch, torch.nn as nn, sparsa
    >>> model = sparsa.sparsify(nn.Linear(64, 64), sparsa.Rule(sparsifier=sparsa.sparsifiers.Magnitude(0.9),
    ...                                                        layout="masked"))
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> size = sparsa.save(model, path)
    >>> fresh = sparsa.load(nn.Linear(64, 64), path)         # a plain model becomes sparse as saved
    >>> fresh.weight.layout_name
    'masked'
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any, Dict, List, Mapping, NamedTuple, Tuple, Union

import safetensors
import safetensors.torch as _st
import torch
from torch import Tensor, nn

from .layouts.base import get_layout
from .tensor import SparseTensor
from .tensor_base import normal_layout, outside_inference_mode

__all__ = ["save", "load", "load_state", "CheckpointError", "LoadResult"]

_FORMAT = "sparsa"
_VERSION = 1
_SEP = "::"


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded (corrupt, truncated, or not matching the model)."""


class LoadResult(NamedTuple):
    model: nn.Module
    missing_keys: List[str]
    unexpected_keys: List[str]


# ----------------------------------------------------------------------------- save
def _digest(t: Tensor) -> str:
    if t.numel():
        raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    else:
        raw = t.new_empty(0, dtype=torch.uint8)
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest()


def _state_of(model_or_state: Union[nn.Module, Mapping[str, Any]]) -> Mapping[str, Any]:
    if isinstance(model_or_state, nn.Module):
        return model_or_state.state_dict()
    if isinstance(model_or_state, Mapping):
        return model_or_state
    raise TypeError(
        f"model_or_state must be an nn.Module or a mapping of name -> tensor, got {type(model_or_state).__name__}"
    )


_NARROW = (torch.uint8, torch.int16, torch.int32)


def _narrow(t: Tensor) -> Tensor:
    """Smallest integer dtype holding every value of an integer index tensor (compression)."""
    if t.dtype not in (torch.int64, torch.int32, torch.int16) or t.numel() == 0:
        return t
    lo, hi = int(t.min()), int(t.max())
    for dt in _NARROW:
        info = torch.iinfo(dt)
        if info.min <= lo and hi <= info.max and info.bits < torch.iinfo(t.dtype).bits:
            return t.to(dt)
    return t


def _flatten(state: Mapping[str, Any]) -> Tuple[Dict[str, Tensor], Dict[str, Any]]:
    tensors: Dict[str, Tensor] = {}
    sparse: Dict[str, Any] = {}
    storages: set = set()

    def put(name: str, t: Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages:
                t = t.clone()  # safetensors refuses shared storage (tied weights); store a copy
            storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t

    for key, val in state.items():
        if not isinstance(key, str) or _SEP in key:
            raise ValueError(f"state key {key!r} must be a string without {_SEP!r}")
        if isinstance(val, SparseTensor):
            lay = val.sparse_layout
            comps = lay.components()
            casts = {}
            for cname, c in comps.items():
                small = _narrow(c)
                if small.dtype != c.dtype:
                    casts[cname] = str(c.dtype).replace("torch.", "")
                put(f"{key}{_SEP}{cname}", small)
            sparse[key] = {
                "layout": type(lay).name,
                "params": lay.params(),
                "shape": list(lay.shape),
                "dtype": str(lay.dtype).replace("torch.", ""),
                "components": list(comps),
                "casts": casts,
            }
        elif isinstance(val, Tensor):
            put(key, val)
        else:
            raise TypeError(
                f"cannot save state entry {key!r} of type {type(val).__name__}: only tensors "
                "are stored (safetensors); drop it or convert it to a tensor"
            )
    return tensors, sparse


def _umask() -> int:
    """The process umask, read without changing it where Linux reports it (os.umask sets it briefly)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save(model_or_state: Union[nn.Module, Mapping[str, Any]], path: Union[str, os.PathLike]) -> int:
    """Write ``model_or_state`` (a module or a state dict) to ``path``; returns the file size in bytes.

    Sparse tensors are stored compressed (their layout components). The write is atomic: a temp
    file in the same directory is fsynced and then renamed over ``path``, so a crash mid-save leaves
    any previous file intact.
    """
    path = os.fspath(path)
    tensors, sparse = _flatten(_state_of(model_or_state))
    try:
        meta_json = json.dumps(
            {
                "format": _FORMAT,
                "version": _VERSION,
                "sparse": sparse,
                "digests": {k: _digest(v) for k, v in tensors.items()},
            }
        )
    except TypeError as e:
        raise ValueError(f"layout parameters must be JSON-serialisable to be saved: {e}") from None
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        _st.save_file(tensors, tmp, metadata={_FORMAT: meta_json})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would make the checkpoint private, unlike open()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return os.path.getsize(path)


# ----------------------------------------------------------------------------- load
def _read(path: str, verify: bool) -> Tuple[Dict[str, Tensor], Dict[str, Any], Dict[str, str]]:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            # clone: fresh, 64-byte aligned storage (file offsets are not aligned, and BLAS results
            # can depend on alignment; a loaded model must compute exactly what the saved one did)
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncation/garbage
        raise CheckpointError(
            f"{path}: not a readable safetensors checkpoint (truncated or corrupted?): {type(e).__name__}: {e}"
        ) from None
    info: Dict[str, Any] = {"sparse": {}, "digests": {}}
    if _FORMAT in meta:
        try:
            info = json.loads(meta[_FORMAT])
            if not isinstance(info, dict) or info.get("format") != _FORMAT:
                raise ValueError("unexpected metadata structure")
        except ValueError as e:
            raise CheckpointError(f"{path}: corrupted sparsa metadata: {e}") from None
        if int(info.get("version", 0)) > _VERSION:
            raise CheckpointError(
                f"{path}: written by a newer sparsa (format version {info['version']}); upgrade sparsa to load it"
            )
    if verify:
        for k, d in info.get("digests", {}).items():
            if k not in tensors:
                raise CheckpointError(f"{path}: tensor {k!r} listed in the metadata is missing from the file")
            if _digest(tensors[k]) != d:
                raise CheckpointError(f"{path}: tensor {k!r} is corrupted (checksum mismatch)")
    return tensors, info.get("sparse", {}), meta


def _params_from_json(params: Dict[str, Any]) -> Dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}


def load_state(path: Union[str, os.PathLike], *, verify: bool = True) -> Dict[str, Tensor]:
    """Read a checkpoint into a state dict (sparse entries rebuilt as :class:`SparseTensor`)."""
    path = os.fspath(path)
    tensors, sparse, _ = _read(path, verify)
    state: Dict[str, Tensor] = {}
    used = set()
    for key, spec in sparse.items():
        try:
            cls = get_layout(spec["layout"])
        except ValueError as e:
            raise CheckpointError(
                f"{path}: key {key!r} uses an unknown layout: {e} (import the module that registers it before loading)"
            ) from None
        except (KeyError, TypeError):
            raise CheckpointError(f"{path}: key {key!r} has malformed sparse metadata") from None
        names = [f"{key}{_SEP}{c}" for c in spec.get("components", [])]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise CheckpointError(f"{path}: key {key!r}: component tensors {missing} are missing")
        comps = {n.split(_SEP, 1)[1]: tensors[n] for n in names}
        for cname, dt in spec.get("casts", {}).items():
            target = getattr(torch, str(dt), None)
            if cname not in comps or not isinstance(target, torch.dtype) or target.is_floating_point:
                raise CheckpointError(f"{path}: key {key!r}: malformed index dtype {dt!r} for component {cname!r}")
            comps[cname] = comps[cname].to(target)
        try:
            lay = cls.from_components(comps, tuple(spec["shape"]), **_params_from_json(spec.get("params", {})))
            lay.validate()
        except Exception as e:
            raise CheckpointError(f"{path}: key {key!r}: invalid {spec['layout']!r} data: {e}") from None
        with outside_inference_mode():  # a checkpoint loaded under inference mode still gives normal weights
            state[key] = SparseTensor(normal_layout(lay))
        used.update(names)
    for k, t in tensors.items():
        if k in used:
            continue
        if _SEP in k:
            raise CheckpointError(f"{path}: tensor {k!r} looks like a sparse component but has no metadata")
        state[k] = t
    return state


def _owner(model: nn.Module, key: str) -> Tuple[nn.Module, str]:
    prefix, _, attr = key.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), attr


def load(
    model: nn.Module,
    path: Union[str, os.PathLike],
    strict: bool = True,
    *,
    verify: bool = True,
    return_keys: bool = False,
):
    """Load ``path`` into ``model`` (typically a freshly built, dense one) and return the model.

    Entries saved sparse become ``nn.Parameter(SparseTensor)`` in their saved layout (on the
    parameter's device and dtype), so the model ends up sparse exactly as saved; dense entries are
    copied in place. Raises :class:`CheckpointError` (a ``ValueError``) naming the file and key for
    corrupted/truncated files, unknown layouts, shape mismatches and (if ``strict``)
    missing/unexpected keys. With ``return_keys=True`` returns a :class:`LoadResult`.
    """
    path = os.fspath(path)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    state = load_state(path, verify=verify)
    expected = model.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{path}: checkpoint does not match the model: missing keys {missing}, "
            f"unexpected keys {unexpected} (pass strict=False to load the rest)"
        )
    for k, v in state.items():
        if k in expected and tuple(expected[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"{path}: key {k!r} has shape {tuple(v.shape)} in the checkpoint but "
                f"{tuple(expected[k].shape)} in the model (a model of another size?)"
            )
    memo: Dict[int, Tensor] = {}
    with torch.no_grad():
        for k, v in state.items():
            if k not in expected:
                continue
            cur = expected[k]
            if id(cur) in memo:  # tied tensors: assign the same object again
                mod, attr = _owner(model, k)
                _set(mod, attr, memo[id(cur)])
                continue
            mod, attr = _owner(model, k)
            if isinstance(v, SparseTensor):
                lay = v.sparse_layout
                if lay.dtype != cur.dtype or lay.device != cur.device:
                    lay = lay.to(device=cur.device, dtype=cur.dtype)
                new: Tensor = SparseTensor(lay)
                if attr in mod._parameters:
                    new = nn.Parameter(new, requires_grad=cur.requires_grad)
            elif isinstance(cur, SparseTensor) or not cur.is_floating_point() and v.dtype != cur.dtype:
                new = v.to(device=cur.device, dtype=cur.dtype)
                if attr in mod._parameters:
                    new = nn.Parameter(new, requires_grad=cur.requires_grad)
            else:
                cur.copy_(v)
                new = cur
            if new is not cur:
                _set(mod, attr, new)
            memo[id(cur)] = new
    if return_keys:
        return LoadResult(model, missing, unexpected)
    return model


def _set(mod: nn.Module, attr: str, value: Tensor) -> None:
    if attr in mod._buffers:
        mod._buffers[attr] = value
    else:
        setattr(mod, attr, value)
