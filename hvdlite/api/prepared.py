"""A steady-state submission: the in-place allreduce of one tensor that stays the
same from step to step (a gradient bucket), checked and described once.

The first ``PreparedAllreduce(...)`` does everything a call does (the process
set, the arguments, the dtype, the descriptor), with the same error markers on
failure. Each ``submit()`` after that builds one Request from the stored
descriptor and hands it to the engine: no name formatting, no checks, no
descriptor, no conversion. The engine's response cache then agrees the request
with one bit, so a step costs one such call per bucket.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from hvdlite.api.adapter import TensorAdapter
from hvdlite.api.process_set import ProcessSet
from hvdlite.api.submission import (ARGUMENT_ERRORS, Call, Input, check_reduction, check_scale,
                                    inplace_output, reduce_op, returning, _unfenced)
from hvdlite.errors import UsageError
from hvdlite.negotiation.requests import Descriptor, Kind, Request
from hvdlite.reduce_op import ReduceOp


class PreparedAllreduce:
    """``allreduce_async_(tensor, name=name, ...)``, ready to resubmit every step."""
    __slots__ = ("_engine", "_set_id", "_desc", "_array", "_finish", "_adapter", "_tensor",
                 "name")

    def __init__(self, adapter: TensorAdapter, tensor: Any, name: str, op: int,
                 prescale: float = 1.0, postscale: float = 1.0,
                 process_set: Optional[ProcessSet] = None) -> None:
        call = Call(Kind.ALLREDUCE, name, process_set)
        try:
            reduction = reduce_op(op)
            if reduction is ReduceOp.ADASUM:
                raise UsageError(f"'{name}': a prepared allreduce does not run Adasum")
            source = Input(adapter, tensor, "allreduce_")
            check_reduction(source, reduction, name)
            _, writeback = inplace_output(source, "allreduce_", adapter.writable(tensor))
            if writeback is not None:
                raise UsageError(f"'{name}': a prepared allreduce needs a contiguous tensor")
            fields = source.fields()
            fields.pop("ready", None)
            fields.pop("adapter", None)
            self._desc = Descriptor(name, Kind.ALLREDUCE, op=int(reduction),
                                    prescale=check_scale(prescale, "prescale_factor"),
                                    postscale=check_scale(postscale, "postscale_factor"),
                                    **fields)
        except ARGUMENT_ERRORS as error:
            call.mark(error)
            raise
        self._engine, self._set_id, self.name = call.engine, call.set_id, name
        self._array = source.array
        self._adapter, self._tensor = adapter, tensor
        finish = returning(adapter, tensor, inplace=True)
        gpu = self._desc.device != "cpu"
        self._finish: Optional[Callable[[Any], Any]] = _unfenced(adapter, finish) if gpu else finish

    def submit(self) -> int:
        """Queue this step's reduction; returns its handle (see ``synchronize``)."""
        request = Request(self._desc, self._set_id, self._array, self._array)
        if self._desc.device != "cpu":      # order the engine after the framework's stream
            request.ready = self._adapter.ready_event(self._tensor)
        return self._engine.submit(request, self._finish)
