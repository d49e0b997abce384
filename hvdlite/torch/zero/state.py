"""A ZeroRedundancyOptimizer's state (optimizer.py) as a whole, and back into shares.

The whole state has the plain optimizer's format, over the same parameters in the
same groups: ``{"state": {index: {key: value}}, "param_groups": [...]}``, indices
counted across the groups in order, each element-wise tensor (momentum, Adam's
moments) shaped as its parameter. It says nothing about ranks, so it loads at any
world size, into the plain ``optimizer_class`` as into a ZeroRedundancyOptimizer.

``gather`` moves the element-wise tensors as the parameters move after a step, chunk by
chunk (an allgather each), so no rank holds more than one chunk of another's share
at a time, and only the ranks that keep the result build it. What is not element-wise
(Adam's ``step``) comes from the rank that owns the parameter's first element, with
the names of its keys, in one object exchange.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Optional

import torch

from hvdlite.api import collectives, objects, runtime
from hvdlite.errors import MismatchError, UsageError
from hvdlite.torch.adapter import TORCH
from hvdlite.torch.mpi_ops import synchronize

if TYPE_CHECKING:
    from hvdlite.torch.zero.optimizer import ZeroRedundancyOptimizer


def _elementwise(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


def gather(opt: ZeroRedundancyOptimizer, keep: bool) -> Optional[dict[str, Any]]:
    """Collective over the optimizer's process set: the whole state on the ranks that
    ``keep`` it (None on the others)."""
    firsts: dict[int, dict[str, Any]] = {}      # position -> its non-element-wise state
    keys: dict[int, list[str]] = {}             # position -> its element-wise keys
    dtypes: dict[tuple[int, str], str] = {}     # (space, key) -> the state's dtype
    for space, piece, tensor in opt._pieces:
        state = opt._local.state.get(tensor)
        if not state:
            continue
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                if not _elementwise(value, tensor.numel()):
                    raise UsageError(
                        f"rank {runtime.rank()}: {opt._what}: the wrapped optimizer's state "
                        f"'{key}' of parameter {piece.position} has shape "
                        f"{tuple(value.shape)}, not one value per element; "
                        "ZeroRedundancyOptimizer shards element-wise optimizers only")
                dtypes[(space.index, key)] = str(value.dtype)
        if piece.start == 0:
            keys[piece.position] = [k for k, v in state.items() if _elementwise(v, tensor.numel())]
            firsts[piece.position] = {k: (v.cpu() if torch.is_tensor(v) else v)
                                      for k, v in state.items() if k not in keys[piece.position]}
    gathered = objects.allgather_object((firsts, keys, dtypes), name=f"{opt._what}.state",
                                        process_set=opt.process_set)
    for theirs_firsts, theirs_keys, theirs_dtypes in gathered:
        firsts.update(theirs_firsts)
        keys.update(theirs_keys)
        for where, dtype in theirs_dtypes.items():
            dtypes.setdefault(where, dtype)
    state: dict[int, dict[str, Any]] = {p: dict(firsts[p]) for p in sorted(firsts)}
    for (space_index, key), dtype in sorted(dtypes.items()):
        _gather_key(opt, opt._spaces[space_index], key, getattr(torch, dtype.split(".")[-1]),
                    keys, state if keep else None)
    if not keep:
        return None
    return {"state": state, "param_groups": groups(opt)}


def _gather_key(opt: ZeroRedundancyOptimizer, space: Any, key: str, dtype: torch.dtype,
                keys: dict[int, list[str]], state: Optional[dict[int, dict[str, Any]]]) -> None:
    shard = torch.zeros(space.shard_size, dtype=dtype, device=space.device)
    for piece_space, piece, tensor in opt._pieces:
        value = opt._local.state.get(tensor, {}).get(key)
        if piece_space is space and value is not None:
            shard[piece.offset:piece.offset + piece.stop - piece.start] = value.reshape(-1)
    for k, chunk in enumerate(space.chunks):
        handle = collectives.allgather_async(
            TORCH, shard[chunk.mine[0]:chunk.mine[1]], f"{opt._what}.state.{key}.{space.index}.{k}",
            opt.process_set)
        flat = synchronize(handle)
        if state is None:
            continue
        for position in chunk.positions:
            if key not in keys.get(position, ()):
                continue
            whole = state[position].get(key)
            if whole is None:
                whole = state[position][key] = torch.empty(
                    opt._params[position].shape, dtype=dtype, device=space.device)
            for _, in_chunk, in_param in space.overlap(chunk, position):
                whole.view(-1)[in_param] = flat[in_chunk]


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings: all but its parameters."""
    return {key: value for key, value in group.items() if key != "params"}


def groups(opt: ZeroRedundancyOptimizer) -> list[dict[str, Any]]:
    """The optimizer's groups in the plain format: hyperparameters, and indices."""
    return _indexed(opt.param_groups, [len(group["params"]) for group in opt.param_groups])


def _indexed(settings: list[dict[str, Any]], counts: list[int]) -> list[dict[str, Any]]:
    """Groups of ``settings``' hyperparameters over ``counts`` parameters each, numbered
    across the groups in order, as ``state_dict()`` numbers them."""
    listed, first = [], 0
    for group, count in zip(settings, counts):
        listed.append({**hyperparameters(group), "params": list(range(first, first + count))})
        first += count
    return listed


def load(opt: ZeroRedundancyOptimizer, state_dict: dict[str, Any]) -> None:
    """Collective: every rank checks the whole state against its parameters (any rank's
    problem is a MismatchError on every rank) and keeps its share."""
    problem = _problem(opt, state_dict)
    verdicts = objects.allgather_object(problem, name=f"{opt._what}.load",
                                        process_set=opt.process_set)
    bad = [(rank, text) for rank, text in enumerate(verdicts) if text]
    if bad:
        listing = "; ".join(f"rank {rank}: {text}" for rank, text in bad)
        raise MismatchError(
            f"rank {runtime.rank()}: {opt._what}: the state dict does not fit the "
            f"optimizer's parameters ({listing}). Load a state dict saved from the same "
            "model and parameter groups")
    for group, saved in zip(opt.param_groups, state_dict["param_groups"]):
        group.update(hyperparameters(saved))
    whole = {int(k): v for k, v in state_dict["state"].items()}
    local_params = [t for group in opt._local.param_groups for t in group["params"]]
    index_of = {id(t): i for i, t in enumerate(local_params)}
    local_state = {}
    for _, piece, tensor in opt._pieces:
        saved = whole.get(piece.position)
        if saved is None:
            continue
        numel = opt._params[piece.position].numel()
        # Each piece its own copy of every value: an optimizer steps its counters in
        # place (Adam's ``step``), once per piece of the parameter.
        local_state[index_of[id(tensor)]] = {
            key: (value.reshape(-1)[piece.start:piece.stop].clone()
                  if _elementwise(value, numel) else
                  value.clone() if torch.is_tensor(value) else copy.deepcopy(value))
            for key, value in saved.items()}
    local_groups = _indexed(opt.param_groups,
                            [len(local["params"]) for local in opt._local.param_groups])
    opt._local.load_state_dict({"state": local_state, "param_groups": local_groups})


def _problem(opt: ZeroRedundancyOptimizer, state_dict: Any) -> str:
    """What keeps ``state_dict`` from fitting this rank's optimizer ('' if nothing)."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        return "not an optimizer state dict (no 'state' and 'param_groups')"
    saved = [len(group.get("params", ())) for group in state_dict["param_groups"]]
    mine = [len(group["params"]) for group in opt.param_groups]
    if saved != mine:
        return f"its groups hold {saved} parameters, the optimizer's {mine}"
    for key, entries in state_dict["state"].items():
        position = int(key)
        if not 0 <= position < len(opt._params):
            return f"it has state for parameter {position}, of {len(opt._params)}"
        param = opt._params[position]
        for name, value in entries.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                return (f"state '{name}' of parameter {position} is {tuple(value.shape)}, "
                        f"the parameter {tuple(param.shape)}")
    return ""
