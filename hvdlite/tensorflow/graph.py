"""Running eager collectives from inside ``tf.function``.

A collective is a blocking Python call, so inside a graph it runs as a
``tf.py_function`` (stateful: tf.function's automatic control dependencies then
run the collectives of one function in program order on every rank, so two of
them can never wait on each other from different TensorFlow threads).

Names must match across ranks. ``tf.py_function`` bodies run on TensorFlow's
own threads, whose Python names differ from rank to rank, so the per-thread
counters that name unnamed eager ops cannot be used there. Every graph-mode op
is named at trace time instead, from the graph: ``<kind>.<input tensor name>``,
made unique within the graph. Ranks that trace the same code get the same names,
even when one rank retraces and another does not.

XLA cannot compile a py_function, and TensorFlow cannot keep one op of a
``tf.function(jit_compile=True)`` outside XLA (outside compilation is for TPUs
only), so a collective traced into such a function raises XlaCompileError at
trace time, naming the op and the ways out, instead of XLA's "No registered
'EagerPyFunc' OpKernel" when the function first runs.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from hvdlite.errors import HvdliteError, UsageError
from hvdlite.tensorflow.errors import in_tensorflow_terms
from hvdlite.tensorflow.adapter import is_keras_variable


class XlaCompileError(UsageError):
    """A collective was traced into a function that XLA must compile."""


def eager() -> bool:
    return tf.executing_eagerly()


def in_xla() -> bool:
    """Tracing a function that XLA must compile (jit_compile=True), or one it calls."""
    if eager():
        return False
    # Private, but the only way to ask: jit_compile=True traces inside an XLA
    # control-flow context, which this walks up from the current graph.
    from tensorflow.python.ops import control_flow_util
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def refuse_xla(fn: Callable[..., Any]) -> None:
    if in_xla():
        what = fn.__qualname__.replace("_Distributed.", "DistributedOptimizer.")
        if "." not in what:
            what = f"hvdlite.tensorflow.{what}"
        raise XlaCompileError(
            f"{what} cannot run inside tf.function(jit_compile=True): hvdlite's collectives "
            "are tf.py_function ops, which XLA cannot compile, and TensorFlow cannot keep "
            "an op of a jit-compiled function outside XLA. Use jit_compile=False for this "
            "function, or call the collective outside the compiled function (compile the "
            "forward and backward pass, reduce the gradients outside it).")


def as_tensor(value: Any) -> tf.Tensor:
    """A tensor for a tensor, a tf.Variable's or a Keras variable's current value."""
    if is_keras_variable(value):
        value = value.value
    return tf.convert_to_tensor(value)


def graph_name(kind: str, name: Optional[str], tensor: Any) -> Optional[str]:
    """``name`` as given; unnamed ops: None when eager (the runtime's counters name
    them), else a name derived from the graph, identical on every rank."""
    if name is not None or eager():
        return name
    source = getattr(tensor, "name", None) or "tensor"
    if source.split(":")[0].isdigit():
        # An eager tensor captured by the function: TF names it by the tensor's id, a
        # count of the tensors this process made, which differs between ranks.
        source = "captured"
    base = f"{kind}.{re.sub(r'[^A-Za-z0-9_./-]', '_', source)}"
    return tf.compat.v1.get_default_graph().unique_name(base, mark_as_used=True)


def run(fn: Callable[..., Any], inputs: Sequence[tf.Tensor], dtypes: Sequence[tf.DType],
        shapes: Sequence[Any]) -> list[tf.Tensor]:
    """``fn(*inputs)`` on eager tensors, returning a list: called directly when
    eager, else as a py_function whose outputs get the given static shapes."""
    if eager():
        result = fn(*inputs)
        return list(result) if isinstance(result, (list, tuple)) else [result]

    def body(*tensors: tf.Tensor) -> list[tf.Tensor]:
        result = fn(*tensors)
        return list(result) if isinstance(result, (list, tuple)) else [result]
    outputs = tf.py_function(body, list(inputs), Tout=list(dtypes), name="HvdliteCollective")
    for output, shape in zip(outputs, shapes):
        output.set_shape(shape)
    return list(outputs)


def rows_shape(tensor: tf.Tensor) -> tf.TensorShape:
    """Static shape of a result whose first dimension varies (allgather, alltoall)."""
    shape = tensor.shape
    return tf.TensorShape([None]) if shape.rank == 0 else tf.TensorShape([None]).concatenate(
        shape[1:])


def entry_point(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A public function of the binding: AutoGraph leaves its body alone (it is
    Python to run at trace time, not code to convert), it refuses to be traced
    into an XLA-compiled function, and its hvdlite errors reach the caller as
    themselves (and as the TensorFlow error Horovod raises, see ``errors``)
    rather than as AutoGraph StagingErrors."""
    def checked(*args: Any, **kwargs: Any) -> Any:
        refuse_xla(fn)
        return fn(*args, **kwargs)
    plain = tf.autograph.experimental.do_not_convert(checked)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return plain(*args, **kwargs)
        except HvdliteError as error:
            both = in_tensorflow_terms(error)
            both.ag_pass_through = True   # read by AutoGraph's error rewriting
            if both is error:
                raise
            raise both from error.__cause__
    return call
