"""Horovod's ``DistributedGradientTape``: a ``tf.GradientTape`` whose
``gradient()`` returns gradients averaged across ranks (eager or in tf.function)."""
from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

import hvdlite as _hvd
from hvdlite.api.compression import Compression, Compressor
from hvdlite.reducer.settings import Groups
from hvdlite.api.process_set import ProcessSet
from hvdlite.errors import HvdliteTypeError
from hvdlite.tensorflow import graph
from hvdlite.tensorflow.gradients import GradientAverager


class DistributedGradientTape:
    """Wraps a tape by composition: recording, ``watch``, ``jacobian``... are the
    tape's own; ``gradient`` averages the result across ranks (one grouped op per
    group). A missing gradient (None) takes part as zeros; one that no rank has
    comes back None, so an optimizer skips its variable as in one process.
    ``register_local_source(variable)`` keeps a variable's gradient local (not
    reduced; divided by the set size when ``scale_local_gradients``).

    Args:
        gradtape: the ``tf.GradientTape`` to wrap.
        device_dense: accepted for Horovod, unused.
        device_sparse: accepted for Horovod, unused.
        compression: ``Compression.none``, ``.fp16`` or ``.bf16`` on the wire.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors
            instead of allgathering their rows.
        op: ``hvd.Average`` (the default) or ``hvd.Sum``.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        num_groups: Horovod's spelling of ``groups=n``.
        groups: a number of groups, or lists of variables, each reduced as one op.
        process_set: the ranks to average over (default: every rank).
        scale_local_gradients: divide the gradients of local sources by the set size.
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "",
                 device_sparse: str = "", compression: type[Compressor] = Compression.none,
                 sparse_as_dense: bool = False, op: int = _hvd.Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Groups = None, process_set: Optional[ProcessSet] = None,
                 scale_local_gradients: bool = True) -> None:
        if not isinstance(gradtape, tf.GradientTape):
            raise HvdliteTypeError(f"DistributedGradientTape wraps a tf.GradientTape; got "
                                   f"{type(gradtape).__module__}.{type(gradtape).__name__}")
        self._tape = gradtape
        self._averager = GradientAverager(
            "DistributedGradientTape", compression, sparse_as_dense, op,
            gradient_predivide_factor, groups if groups is not None else (num_groups or None),
            process_set, scale_local_gradients)

    def __enter__(self) -> "DistributedGradientTape":
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_tape"], name)

    def register_local_source(self, source: Any) -> None:
        """Horovod's worker-local source: its gradient is this rank's own."""
        if not hasattr(source, "shape") or not hasattr(source, "dtype"):
            raise HvdliteTypeError(f"register_local_source takes a variable; got "
                                   f"{type(source).__name__}")
        self._averager.register_local(source)

    @graph.entry_point
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        # None and IndexedSlices are leaves for tf.nest, so both lists line up.
        averaged = self._averager(tf.nest.flatten(grads), tf.nest.flatten(sources))
        return tf.nest.pack_sequence_as(sources, averaged)

    def get_local_and_global_gradients(self, target: Any, sources: Any,
                                       output_gradients: Any = None) -> tuple[list, list]:
        """``gradient()``'s results split into (local, shared) lists of
        (variable, gradient) pairs, in the order of ``sources``."""
        flat = tf.nest.flatten(sources)
        grads = tf.nest.flatten(self.gradient(target, sources, output_gradients))
        pairs = list(zip(flat, grads))
        local = [p for p in pairs if id(p[0]) in self._averager.local]
        shared = [p for p in pairs if id(p[0]) not in self._averager.local]
        return local, shared


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "",
                                   compression: type[Compressor] = Compression.none,
                                   sparse_as_dense: bool = False, op: int = _hvd.Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Groups = None,
                                   process_set: Optional[ProcessSet] = None,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True
                                   ) -> DistributedGradientTape:
    """A DistributedGradientTape whose ``local_layers``' variables stay worker-local."""
    from hvdlite._keras.layers import local_layer_variables    # Keras: imported on use
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for variable in local_layer_variables(local_layers, "PartialDistributedGradientTape"):
        tape.register_local_source(variable)
    return tape
