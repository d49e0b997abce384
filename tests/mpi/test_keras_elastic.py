"""hvd.elastic for Keras 3 on TensorFlow, on every rank: KerasState and
TensorFlowKerasState commit, restore and sync every model and optimizer variable
bitwise (the iteration counter, the dropout seed and batch-norm statistics
included), through memory and through the committed file; the callbacks keep
epoch and batch and commit every N batches; the run decorator recovers from a
collective failure raised inside a compiled step; bad inputs are refused."""
from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np
import pytest

from tests.mpi.conftest import assert_identical_everywhere, keras_on_tensorflow, keras_optimizers

tf, keras = keras_on_tensorflow()

import hvdlite.keras as hvd  # noqa: E402
import hvdlite.tensorflow as hvdtf  # noqa: E402
from hvdlite.errors import PeerLostError, StateError, UsageError  # noqa: E402

pytestmark = pytest.mark.timeout(120)
BATCH = 4          # rows per rank per step


def _model(seed: int) -> "keras.Model":
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Input((5,)), keras.layers.Dense(6, activation="tanh"),
                             keras.layers.Dropout(0.25), keras.layers.BatchNormalization(),
                             keras.layers.Dense(2)])


def _compiled(seed: int, make_opt: Callable[[], Any]) -> "keras.Model":
    model = _model(seed)
    model.compile(optimizer=hvd.DistributedOptimizer(make_opt()), loss="mse")
    return model


def _data(steps: int, salt: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * salt + hvd.rank())
    return (rng.normal(size=(steps * BATCH, 5)).astype("float32"),
            rng.normal(size=(steps * BATCH, 2)).astype("float32"))


def _fit(model: "keras.Model", steps: int, salt: int = 0, **kwargs: Any) -> None:
    x, y = _data(steps, salt)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, **kwargs)


def _everything(model: "keras.Model") -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in model.variables + model.optimizer.variables]


def _same_bits(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.tobytes() == y.tobytes()
                                    for x, y in zip(a, b))


def _everywhere(**checks: Any) -> None:
    """Assert ``checks`` (name: value that must be true) on every rank's values, after
    exchanging them: a rank that failed alone must not leave the others waiting in
    the test's next collective."""
    gathered = hvd.allgather_object(checks, name="kelastic.checks")
    failed = {(rank, name) for rank, values in enumerate(gathered)
              for name, value in values.items() if not value}
    assert not failed, f"failed (rank, check): {sorted(failed)}"



@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_keras_state_sync_commit_restore_is_bitwise(opt: str) -> None:
    model = _compiled(seed=hvd.rank(), make_opt=keras_optimizers(keras)[opt])
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    built = state.optimizer is model.optimizer and model.optimizer.built
    state.sync()                                     # every rank takes rank 0's variables
    assert_identical_everywhere(_everything(model))
    _fit(model, steps=2)
    state.epoch = 1
    state.commit()
    committed = _everything(model)
    _fit(model, steps=3, salt=1)
    state.epoch = 2
    moved = int(model.optimizer.iterations.numpy()) == 5
    state.restore()
    checks = dict(built=built, moved=moved, epoch=state.epoch == 1, model=state.model is model,
                  iterations=int(model.optimizer.iterations.numpy()) == 2,
                  bitwise=_same_bits(_everything(model), committed))
    _fit(model, steps=1, salt=2)                     # the restored model trains on
    _everywhere(**checks)
    assert_identical_everywhere([np.array(v.numpy()) for v in model.trainable_variables])


def test_committed_file_resumes_bitwise_in_a_fresh_model(elastic_dir: str) -> None:
    make_opt = keras_optimizers(keras)["adam"]
    model = _compiled(seed=5, make_opt=make_opt)
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    state.sync()
    _fit(model, steps=3)
    state.epoch, state.batch = 1, 3
    state.commit()
    committed = _everything(model)
    _fit(model, steps=1, salt=1)                     # never committed

    fresh = _compiled(seed=99 + hvd.rank(), make_opt=make_opt)   # as a restarted job
    resumed = hvd.elastic.KerasState(fresh, epoch=0, batch=0)
    loaded = resumed.load_persisted() == (hvd.rank() == 0)
    resumed.sync()
    # BatchNorm statistics are per rank (not reduced): rank 0's own commit comes
    # back bitwise, and sync gives it to every rank.
    _everywhere(loaded=loaded, attributes=(resumed.epoch, resumed.batch) == (1, 3),
                iterations=int(fresh.optimizer.iterations.numpy()) == 3,
                bitwise=hvd.rank() != 0 or _same_bits(_everything(fresh), committed))
    assert_identical_everywhere(_everything(fresh))


def test_tensorflow_keras_state_in_a_custom_loop() -> None:
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([keras.layers.Input((5,)), keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    state = hvdtf.elastic.TensorFlowKerasState(model, optimizer, step=0)
    state.sync()
    x, y = _data(1)

    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - tf.reduce_sum(y, 1, keepdims=True)) ** 2)
        tape = hvdtf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        state.step += 1

    step()
    state.commit()
    committed = [np.array(v.numpy()) for v in model.variables + optimizer.variables]
    step()
    step()
    state.restore()
    _everywhere(step=state.step == 1, iterations=int(optimizer.iterations.numpy()) == 1,
                bitwise=_same_bits([np.array(v.numpy())
                                    for v in model.variables + optimizer.variables], committed))
    assert_identical_everywhere(committed)

    variables = [tf.Variable(np.full((2, 3), hvd.rank(), "float64")), tf.Variable(hvd.rank())]
    plain = hvdtf.elastic.TensorFlowState(variables, epoch=hvd.rank())
    plain.sync()
    synced = plain.epoch == 0 and variables[0].numpy().sum() == 0 and variables[1].numpy() == 0
    plain.commit()
    variables[0].assign_add(tf.ones((2, 3), "float64"))
    plain.restore()
    _everywhere(synced=synced, restored=variables[0].numpy().sum() == 0,
                same_objects=plain.variables[1] is variables[1])


def _recorded_commits(state: Any) -> list[tuple[int, int]]:
    """Wrap ``state.commit`` to log (epoch, batch) at every commit."""
    log: list[tuple[int, int]] = []
    commit = state.commit

    def recording() -> None:
        log.append((state.epoch, state.batch))
        commit()
    state.commit = recording
    return log


def _callbacks(state: Any, every: int) -> list[Any]:
    return [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=every)]


def _expected_commits(epochs: int, steps: int, every: int, epoch0: int = 0,
                      batch0: int = 0) -> list[tuple[int, int]]:
    expected, remaining = [], every
    for epoch in range(epochs):
        first = batch0 if epoch == 0 else 0
        for batch in range(first, first + (steps if epoch else steps - batch0)):
            remaining -= 1
            if remaining == 0:
                expected.append((epoch0 + epoch, batch + 1))
                remaining = every
        expected.append((epoch0 + epoch + 1, 0))
    return expected


@pytest.mark.parametrize("every", [1, 4])
def test_callbacks_update_epoch_and_batch_and_commit_every_n_batches(every: int) -> None:
    model = _compiled(seed=3, make_opt=keras_optimizers(keras)["sgd"])
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    state.sync()
    log = _recorded_commits(state)
    _fit(model, steps=6, epochs=2, callbacks=_callbacks(state, every))
    expected = _expected_commits(epochs=2, steps=6, every=every)
    _everywhere(log=log == expected, commits=state._commits == len(expected),
                end=(state.epoch, state.batch) == (2, 0))


def test_callbacks_resume_mid_epoch_and_with_initial_epoch() -> None:
    model = _compiled(seed=3, make_opt=keras_optimizers(keras)["sgd"])
    state = hvd.elastic.KerasState(model, epoch=1, batch=2)     # as after a restart
    log = _recorded_commits(state)
    callbacks = _callbacks(state, every=3)
    _fit(model, steps=4, epochs=1, callbacks=callbacks)         # the rest of epoch 1
    rest = log == _expected_commits(epochs=1, steps=6, every=3, epoch0=1, batch0=2)
    log.clear()
    _fit(model, steps=6, initial_epoch=state.epoch, epochs=4, callbacks=callbacks)
    _everywhere(rest=rest, later=log == _expected_commits(epochs=2, steps=6, every=3, epoch0=2),
                end=(state.epoch, state.batch) == (4, 0))


def test_run_recovers_from_a_collective_failure_inside_a_compiled_step() -> None:
    model = _compiled(seed=hvd.rank(), make_opt=keras_optimizers(keras)["sgd"])
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    calls: list[int] = []

    def fail(x: Any) -> Any:
        raise PeerLostError("simulated: rank 1 stopped answering")

    @tf.function
    def step_that_fails(x: Any) -> Any:
        return tf.py_function(fail, [x], Tout=tf.float32)

    @hvd.elastic.run
    def train(state: Any) -> list[np.ndarray]:
        calls.append(int(model.optimizer.iterations.numpy()))
        if len(calls) == 1:
            _fit(model, steps=2)
            state.commit()
            _fit(model, steps=1, salt=1)
            step_that_fails(tf.constant(1.0))
        return _everything(model)

    after = train(state)
    # The retry started from the commit.
    _everywhere(calls=calls == [0, 2], iterations=int(model.optimizer.iterations.numpy()) == 2)
    assert_identical_everywhere(after)
    with pytest.raises(tf.errors.OpError) as raised:
        step_that_fails(tf.constant(1.0))
    translated = hvdtf.elastic.collective_failure(raised.value)
    assert type(translated) is PeerLostError and "rank 1 stopped" in str(translated)
    assert isinstance(translated, hvd.HorovodInternalError)


def test_bad_inputs_are_refused_with_typed_errors() -> None:
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(UsageError, match="must be built first"):
        hvd.elastic.KerasState(unbuilt)
    with pytest.raises(UsageError, match="needs a Keras model"):
        hvd.elastic.KerasState("model.keras")
    state = hvd.elastic.KerasState(_model(1), keras.optimizers.SGD(0.1), epoch=0)
    with pytest.raises(UsageError, match="batches_per_commit"):
        hvd.elastic.CommitStateCallback(state, batches_per_commit=0)
    with pytest.raises(UsageError, match="batch=0"):
        hvd.elastic.UpdateBatchStateCallback(state)             # no batch attribute
    with pytest.raises(UsageError, match="needs an elastic State"):
        hvd.elastic.UpdateEpochStateCallback({"epoch": 0})


def test_committed_file_of_another_model_is_refused_naming_the_variable(
        elastic_dir: str) -> None:
    state = hvd.elastic.KerasState(_model(1), keras.optimizers.SGD(0.1))
    state.commit()
    hvd.barrier()
    other = keras.Sequential([keras.layers.Input((5,)), keras.layers.Dense(7),
                              keras.layers.Dropout(0.25), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2)])
    resumed = hvd.elastic.KerasState(other, keras.optimizers.SGD(0.1))
    message = ""
    try:
        resumed.load_persisted()                     # rank 0 reads; every rank raises
    except StateError as error:
        message = str(error)
    pattern = r"'model'.*dense.*kernel is float32\[5, 7\].*float32\[5, 6\]"
    _everywhere(refused=re.search(pattern, message) is not None)
