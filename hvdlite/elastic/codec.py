"""A committed value as data that cannot run code: a JSON tree plus raw buffers.

Plain Python values (None, bool, int, float, str, list, dict with string keys)
are the tree itself. NumPy arrays and scalars, torch tensors and bytes become a
tagged node (``{"$ndarray": i, "dtype": "<f4", "shape": [2, 3]}``) that names
buffer ``i``: their raw bytes, so a decoded tensor has the very bits that were
encoded (bfloat16 included, which NumPy has no dtype for). Tuples, dicts with
other keys and ``OrderedDict`` (torch's ``state_dict``, with its ``_metadata``)
have their own tags, so a restore gives back the same types.

Anything else falls back to pickle (a ``$pickle`` node). Unpickling can run
code, so ``persist.read`` hands out a tree from disk only after checking that
nobody but this user can have written it. Every other node is decoded by
building arrays from bytes: a file cannot make the decoder run anything.
"""
from __future__ import annotations

import dataclasses
import math
import pickle
import sys
from collections import OrderedDict
from typing import Any

import numpy as np

from hvdlite.errors import StateError

# Kinds of NumPy dtypes whose bytes are the whole value (no object pointers).
_RAW_KINDS = frozenset("biufcmMSU")
_TAGS = ("$tuple", "$dict", "$odict", "$float", "$bytes", "$ndarray", "$npscalar",
         "$tensor", "$pickle")


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One attribute's committed value: ``tree`` (JSON-ready) and the buffers its
    nodes refer to by index. Immutable bytes: a true snapshot."""
    tree: Any
    buffers: tuple[bytes, ...]


class Malformed(StateError):
    """A tree that this module did not write (a corrupted or crafted file)."""


def encode(value: Any, name: str) -> Encoded:
    """``value`` as an :class:`Encoded`; ``name`` (the attribute) is for errors."""
    encoder = _Encoder(name)
    tree = encoder.node(value, name)
    return Encoded(tree, tuple(encoder.buffers))


def decode(encoded: Encoded) -> Any:
    """The value ``encoded`` holds (fresh objects: later changes cannot reach the
    snapshot). Raises :class:`Malformed` for a tree this module cannot have written."""
    try:
        return _Decoder(encoded.buffers).node(encoded.tree)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        if isinstance(exc, StateError):
            raise
        raise Malformed(f"a node that cannot be decoded ({type(exc).__name__}: {exc})") \
            from exc


def _torch() -> Any:
    """torch if the program imported it (this module never imports it itself)."""
    return sys.modules.get("torch")


def _raw_dtype(dtype: np.dtype) -> bool:
    return dtype.kind in _RAW_KINDS and dtype.fields is None and dtype.subdtype is None


class _Encoder:
    def __init__(self, name: str) -> None:
        self.name = name
        self.buffers: list[bytes] = []

    def add(self, data: bytes) -> int:
        self.buffers.append(data)
        return len(self.buffers) - 1

    def node(self, value: Any, where: str) -> Any:
        kind = type(value)
        if value is None or kind in (bool, int, str):
            return value
        if kind is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if kind is list:
            return [self.node(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if kind is tuple:
            return {"$tuple": [self.node(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if kind is dict:
            return self.mapping(value, where)
        if kind is OrderedDict:
            return self.ordered(value, where)
        if kind is bytes:
            return {"$bytes": self.add(value)}
        if kind is np.ndarray and _raw_dtype(value.dtype):
            return {"$ndarray": self.add(np.ascontiguousarray(value).tobytes()),
                    "dtype": value.dtype.str, "shape": list(value.shape)}
        if isinstance(value, np.generic) and _raw_dtype(value.dtype):
            return {"$npscalar": self.add(value.tobytes()), "dtype": value.dtype.str}
        torch = _torch()
        if torch is not None and kind in (torch.Tensor, torch.nn.Parameter) \
                and _raw_tensor(torch, value):
            return self.tensor(torch, value)
        return {"$pickle": self.add(self.pickled(value, where))}

    def mapping(self, value: dict, where: str) -> Any:
        if all(type(k) is str and not k.startswith("$") for k in value):
            return {k: self.node(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {"$dict": self.pairs(value, where)}

    def pairs(self, value: dict, where: str) -> list:
        return [[self.node(k, f"{where} key {k!r}"), self.node(v, f"{where}[{k!r}]")]
                for k, v in value.items()]

    def ordered(self, value: OrderedDict, where: str) -> Any:
        # torch's state_dict keeps per-module versions in ``_metadata``, which
        # load_state_dict reads back: kept, as pickle kept it.
        attributes = {k: self.node(v, f"{where}.{k}") for k, v in vars(value).items()
                      if not k.startswith("__")}
        return {"$odict": self.pairs(value, where), "attributes": attributes}

    def tensor(self, torch: Any, value: Any) -> Any:
        flat = value.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        node = {"$tensor": self.add(flat.view(torch.uint8).numpy().tobytes()),
                "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape), "device": str(value.device)}
        if type(value) is torch.nn.Parameter:
            node["parameter"] = True
        if value.requires_grad:
            node["requires_grad"] = True
        return node

    def pickled(self, value: Any, where: str) -> bytes:
        try:
            return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise StateError(
                f"elastic state attribute {self.name!r} cannot be committed: {where} is a "
                f"{type(value).__name__}, which is neither a plain value, an array nor a "
                f"tensor, and cannot be pickled either ({exc}). Keep only such values in "
                "the State (rebuild the others after restore)") from exc


def _raw_tensor(torch: Any, value: Any) -> bool:
    """A dense tensor whose bytes are its value (not sparse, quantized, nested)."""
    return (value.layout == torch.strided and not value.is_quantized
            and not getattr(value, "is_nested", False))


class _Decoder:
    def __init__(self, buffers: tuple[bytes, ...]) -> None:
        self.buffers = buffers

    def buffer(self, index: Any) -> bytes:
        if type(index) is not int or not 0 <= index < len(self.buffers):
            raise Malformed(f"a node names buffer {index!r}; there are {len(self.buffers)}")
        return self.buffers[index]

    def node(self, tree: Any) -> Any:
        if tree is None or type(tree) in (bool, int, float, str):
            return tree
        if type(tree) is list:
            return [self.node(v) for v in tree]
        if type(tree) is not dict:
            raise Malformed(f"unexpected {type(tree).__name__} in the tree")
        tag = next((k for k in tree if k in _TAGS), None)
        if tag is None:
            return {k: self.node(v) for k, v in tree.items()}
        return getattr(self, "tag_" + tag[1:])(tree)

    def tag_tuple(self, tree: dict) -> Any:
        return tuple(self.node(v) for v in _list(tree["$tuple"]))

    def tag_dict(self, tree: dict) -> Any:
        return dict(self.pairs(tree["$dict"]))

    def tag_odict(self, tree: dict) -> Any:
        value = OrderedDict(self.pairs(tree["$odict"]))
        for name, attribute in dict(tree.get("attributes", {})).items():
            if not isinstance(name, str) or name.startswith("__"):
                raise Malformed(f"attribute {name!r} of an OrderedDict")
            setattr(value, name, self.node(attribute))
        return value

    def pairs(self, items: Any) -> list:
        pairs = [_list(pair) for pair in _list(items)]
        if any(len(pair) != 2 for pair in pairs):
            raise Malformed("a dict item is not a [key, value] pair")
        return [(_hashable(self.node(k)), self.node(v)) for k, v in pairs]

    def tag_float(self, tree: dict) -> Any:
        if tree["$float"] not in ("nan", "inf", "-inf"):
            raise Malformed(f"float {tree['$float']!r}")
        return float(tree["$float"])

    def tag_bytes(self, tree: dict) -> Any:
        return bytes(self.buffer(tree["$bytes"]))

    def tag_ndarray(self, tree: dict) -> Any:
        dtype, shape = _np_dtype(tree["dtype"]), _shape(tree["shape"])
        return _from_bytes(self.buffer(tree["$ndarray"]), dtype, shape).copy()

    def tag_npscalar(self, tree: dict) -> Any:
        return _from_bytes(self.buffer(tree["$npscalar"]), _np_dtype(tree["dtype"]), ())[()]

    def tag_tensor(self, tree: dict) -> Any:
        import torch      # a file with tensors was written by a program that had torch
        dtype = getattr(torch, str(tree["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise Malformed(f"torch dtype {tree['dtype']!r}")
        shape, data = _shape(tree["shape"]), self.buffer(tree["$tensor"])
        if len(data) != math.prod(shape) * dtype.itemsize:
            raise Malformed(f"a {dtype}{shape} tensor of {len(data)} bytes")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
            torch.empty(0, dtype=torch.uint8)
        value = raw.view(dtype).reshape(shape).to(str(tree.get("device", "cpu")))
        if tree.get("parameter"):
            return torch.nn.Parameter(value, requires_grad=bool(tree.get("requires_grad")))
        return value.requires_grad_(bool(tree.get("requires_grad")))

    def tag_pickle(self, tree: dict) -> Any:
        # Reached only for our own commits in memory, or a file persist.read checked.
        return pickle.loads(self.buffer(tree["$pickle"]))


def _list(value: Any) -> list:
    if type(value) is not list:
        raise Malformed(f"expected a list, found {type(value).__name__}")
    return value


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise Malformed(f"a dict key of type {type(key).__name__}") from None
    return key


def _shape(shape: Any) -> tuple[int, ...]:
    dims = _list(shape)
    if any(type(d) is not int or d < 0 for d in dims):
        raise Malformed(f"shape {shape!r}")
    return tuple(dims)


def _np_dtype(text: Any) -> np.dtype:
    try:
        dtype = np.dtype(str(text))
    except (TypeError, ValueError):
        raise Malformed(f"NumPy dtype {text!r}") from None
    if not _raw_dtype(dtype):
        raise Malformed(f"NumPy dtype {text!r} is not plain data")
    return dtype


def _from_bytes(data: bytes, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise Malformed(f"a {dtype}{list(shape)} array of {len(data)} bytes")
    return np.frombuffer(data, dtype=dtype).reshape(shape)
