"""hvdlite.keras.DistributedOptimizer's own behaviour (Keras 3 on TensorFlow),
beyond the model.fit equivalence of test_keras_fit.py: its defaults, the
optimizer state it adds (none unless it accumulates), the cadence of
backward_passes_per_step=2 call by call, sparse gradients accumulated, apply()
without variables, and the XLA notice (once, rank 0 only)."""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import numpy as np
import pytest

from tests.mpi.conftest import assert_identical_everywhere, keras_on_tensorflow

tf, keras = keras_on_tensorflow()

import hvdlite.keras as hvd  # noqa: E402
from hvdlite.keras import optimizer as keras_optimizer  # noqa: E402

PER_RANK = 3             # rows per rank per micro-batch
TOLERANCE = 1e-12        # float64 models: only the summation order differs
VOCABULARY, WIDTH = 6, 2


def test_the_defaults_are_horovods_and_cannot_be_changed_in_place() -> None:
    wrapped = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    settings = type(wrapped)._hvdlite
    assert (settings.name, settings.sparse_as_dense, settings.passes,
            settings.average_aggregated, settings.op, settings.predivide,
            settings.groups) == (None, False, 1, False, hvd.Average, 1.0, None)
    assert settings.compression is hvd.Compression.none
    # load_model's re-wrapped optimizers: the same defaults with its compression.
    assert keras_optimizer.Settings(compression=hvd.Compression.none) == dataclasses.replace(
        settings, process_set=None)
    none = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=None)
    assert type(none)._hvdlite.compression is hvd.Compression.none
    # The settings live on a class that every copy of the optimizer shares.
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.passes = 2   # type: ignore[misc]


def _variable_names(optimizer: Any, model: "keras.Model") -> list[str]:
    optimizer.build(model.trainable_variables)
    return [v.path.split("/")[-1] for v in optimizer.variables]


def _dense_model() -> "keras.Model":
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.layers.Input((4,), dtype="float64"),
                             keras.layers.Dense(2, dtype="float64")])


def test_optimizer_state_is_the_plain_optimizers_unless_it_accumulates() -> None:
    model = _dense_model()
    plain = _variable_names(keras.optimizers.SGD(0.1, momentum=0.9), model)
    assert _variable_names(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                           model) == plain
    accumulating = _variable_names(hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), backward_passes_per_step=2), model)
    extra = [name for name in accumulating if name not in plain]
    kinds = [name.rsplit("_hvdlite_", 1)[-1] if "_hvdlite_" in name else name for name in extra]
    assert kinds == ["accumulator"] * len(model.trainable_variables) + ["hvdlite_passes"], extra


def _grads(model: "keras.Model", x: np.ndarray, y: np.ndarray) -> list[Any]:
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    return tape.gradient(loss, model.trainable_variables)


def _batches(count: int, rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(11)
    return [(rng.normal(size=(rows, 4)), rng.normal(size=(rows, 2))) for _ in range(count)]


def _mine(array: np.ndarray) -> np.ndarray:
    return array[hvd.rank() * PER_RANK:(hvd.rank() + 1) * PER_RANK]


def test_two_passes_update_on_every_second_call_with_the_mean_of_both() -> None:
    batches = _batches(4, PER_RANK * hvd.size())
    model = _dense_model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.25), backward_passes_per_step=2,
                                         average_aggregated_gradients=True)
    start = [w.copy() for w in model.get_weights()]
    counts = []
    for x, y in batches:
        optimizer.apply(_grads(model, _mine(x), _mine(y)), model.trainable_variables)
        counts.append(int(optimizer.iterations))
        if counts[-1] == 0:     # accumulating: the weights have not moved yet
            for a, b in zip(model.get_weights(), start):
                np.testing.assert_array_equal(a, b)
    assert counts == [0, 1, 1, 2]
    # One process: the mean gradient of each pair of whole batches, one update each.
    reference = _dense_model()
    plain = keras.optimizers.SGD(0.25)
    for first, second in (batches[:2], batches[2:]):
        pair = [(g1 + g2) / 2 for g1, g2 in zip(_grads(reference, *first),
                                                 _grads(reference, *second))]
        plain.apply(pair, reference.trainable_variables)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)
    assert_identical_everywhere(model.get_weights())


def _embedding_model() -> "keras.Model":
    keras.utils.set_random_seed(9)
    return keras.Sequential([keras.layers.Input((2,), dtype="int32"),
                             keras.layers.Embedding(VOCABULARY, WIDTH, dtype="float64"),
                             keras.layers.Flatten(), keras.layers.Dense(1, dtype="float64")])


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_accumulate_over_two_passes(sparse_as_dense: bool) -> None:
    rng = np.random.default_rng(3)
    rows = PER_RANK * hvd.size()
    steps = [(rng.integers(0, VOCABULARY, size=(rows, 2)).astype("int32"),
              rng.normal(size=(rows, 1))) for _ in range(4)]
    model = _embedding_model()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), sparse_as_dense=sparse_as_dense,
                                         backward_passes_per_step=2,
                                         average_aggregated_gradients=True)

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> None:
        grads = _grads(model, x, y)
        assert type(grads[0]).__name__ == "IndexedSlices"    # the embedding's gradient
        optimizer.apply(grads, model.trainable_variables)
    for x, y in steps:
        step(tf.constant(_mine(x)), tf.constant(_mine(y)))
    assert int(optimizer.iterations) == 2
    reference = _embedding_model()
    plain = keras.optimizers.SGD(0.5)
    for first, second in (steps[:2], steps[2:]):
        pair = [(tf.convert_to_tensor(g1) + tf.convert_to_tensor(g2)) / 2
                for g1, g2 in zip(_grads(reference, *first), _grads(reference, *second))]
        plain.apply(pair, reference.trainable_variables)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)
    assert_identical_everywhere(model.get_weights())


def test_apply_without_variables_uses_the_built_optimizers_and_refuses_unbuilt() -> None:
    model = _dense_model()
    x, y = _batches(1, PER_RANK * hvd.size())[0]
    unbuilt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(hvd.UsageError, match="needs a built optimizer"):
        unbuilt.apply(_grads(model, _mine(x), _mine(y)))
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build(model.trainable_variables)
    before = model.get_weights()
    optimizer.apply(_grads(model, _mine(x), _mine(y)))
    assert int(optimizer.iterations) == 1
    assert all(not np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    assert_identical_everywhere(model.get_weights())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_xla_notice_is_said_once_and_by_rank_zero_only() -> None:
    records = _Records()
    logging.getLogger("hvdlite").addHandler(records)
    keras_optimizer._warned_xla.clear()
    try:
        for _ in range(2):      # two models, each asked twice: still one notice
            model = _dense_model()
            model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                          loss="mse", jit_compile=True)
            assert model.jit_compile is False and model.jit_compile is False
        plain = _dense_model()
        plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
        assert plain.jit_compile is True
    finally:
        logging.getLogger("hvdlite").removeHandler(records)
    notices = [m for m in records.messages if "without XLA" in m]
    assert len(notices) == (1 if hvd.rank() == 0 else 0), notices


def test_apply_refuses_xla_and_its_errors_reach_the_caller_as_themselves() -> None:
    from hvdlite.tensorflow import XlaCompileError
    model = _dense_model()
    x, y = (tf.constant(_mine(a)) for a in _batches(1, PER_RANK * hvd.size())[0])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=True)
    def compiled(x: tf.Tensor, y: tf.Tensor) -> None:
        optimizer.apply(_grads(model, x, y), model.trainable_variables)
    with pytest.raises(XlaCompileError, match=r"DistributedOptimizer\.apply cannot run inside"):
        compiled(x, y)
    unbuilt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))

    @tf.function
    def traced(x: tf.Tensor, y: tf.Tensor) -> None:
        unbuilt.apply(_grads(model, x, y))
    with pytest.raises(hvd.UsageError) as raised:
        traced(x, y)
    # Itself (not AutoGraph's wrapper), in TensorFlow's vocabulary too (tensorflow.errors).
    assert type(raised.value).__bases__ == (hvd.UsageError, tf.errors.InvalidArgumentError)
    assert str(raised.value).startswith("apply(grads) without variables needs a built optimizer")


def test_a_model_saved_while_accumulating_loads_with_its_optimizer_state(tmp_path: Any) -> None:
    model = _dense_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                     backward_passes_per_step=2), loss="mse")
    x, y = _batches(1, 4 * PER_RANK)[0]
    model.fit(x, y, batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 2
    path = str(tmp_path / f"accumulating_{hvd.rank()}.keras")
    model.save(path)
    momentum = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables
                if "momentum" in v.path]
    for load in (hvd.load_model, keras.models.load_model):
        with warnings.catch_warnings():
            warnings.simplefilter("error")      # Keras warns when it skips the state
            loaded = load(path)
        assert int(loaded.optimizer.iterations) == 2
        restored = [keras.ops.convert_to_numpy(v) for v in loaded.optimizer.variables
                    if "momentum" in v.path]
        assert len(restored) == len(momentum) == 2
        for a, b in zip(restored, momentum):
            np.testing.assert_array_equal(a, b)
    # Into a model whose optimizer accumulates: the state goes to the plain part.
    again = _dense_model()
    again.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                     backward_passes_per_step=2), loss="mse")
    again.fit(x, -y, batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)   # other state
    again.load_weights(path)
    restored = [keras.ops.convert_to_numpy(v) for v in again.optimizer.variables
                if "momentum" in v.path]
    for a, b in zip(restored, momentum):
        np.testing.assert_array_equal(a, b)
    # Another optimizer's state does not fit: Keras says so and loads none of it.
    other = _dense_model()
    other.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.1),
                                                     backward_passes_per_step=2), loss="mse")
    other.fit(x, y, batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
    with pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
        other.load_weights(path)            # fewer saved than it has
    more = str(tmp_path / f"adam_{hvd.rank()}.keras")
    other.save(more)
    with pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
        again.load_weights(more)            # more saved than it has
    assert type(hvd.load_model(path, compression=None).optimizer)._hvdlite.compression is (
        hvd.Compression.none)


@pytest.mark.parametrize("name, prefix", [(None, "DistributedSGD"), ("mine", "mine")])
def test_the_name_prefixes_the_optimizers_collectives_and_messages(name: str,
                                                                    prefix: str) -> None:
    model = _dense_model()
    x, y = _batches(1, PER_RANK * hvd.size())[0]
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), name=name)
    grads = _grads(model, _mine(x), _mine(y))
    with pytest.raises(hvd.UsageError, match=rf"^{prefix}: 1 gradients for 2 variables"):
        optimizer.apply(grads[:1], model.trainable_variables)
