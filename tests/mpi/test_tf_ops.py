"""hvdlite.tensorflow collectives on every rank: eager and inside tf.function,
Horovod's gradients, in-place ops on variables, broadcast_variables, bad input."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip(
    "tensorflow", reason="TensorFlow is not installed in this venv (make test's Open MPI venv, .venv-ompi, has NumPy and torch only)")
tf.config.threading.set_intra_op_parallelism_threads(1)

import hvdlite.tensorflow as hvd  # noqa: E402

MODES = ["eager", "function"]


def _mode(fn, mode: str):  # type: ignore[no-untyped-def]
    return fn if mode == "eager" else tf.function(fn)


def _rank_rows(rank: int, rows: int) -> np.ndarray:
    return (np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 100 * rank)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_average_sum_and_grouped(mode: str) -> None:
    r, n = hvd.rank(), hvd.size()
    x = tf.constant(_rank_rows(r, 2))

    def step(t):  # type: ignore[no-untyped-def]
        return (hvd.allreduce(t), hvd.allreduce(t, op=hvd.Sum),
                hvd.grouped_allreduce([t, 2 * t], op=hvd.Sum))
    average, total, grouped = _mode(step, mode)(x)
    expected = sum(_rank_rows(k, 2) for k in range(n))
    np.testing.assert_allclose(total.numpy(), expected)
    np.testing.assert_allclose(average.numpy(), expected / n, rtol=1e-6)
    np.testing.assert_allclose(grouped[1].numpy(), 2 * expected)


@pytest.mark.parametrize("mode", MODES)
def test_allgather_broadcast_alltoall_reducescatter(mode: str) -> None:
    r, n = hvd.rank(), hvd.size()
    ragged = tf.constant(_rank_rows(r, r + 1))

    def step(t, even):  # type: ignore[no-untyped-def]
        received, splits = hvd.alltoall(even, splits=[1] * n)
        return (hvd.allgather(t), hvd.broadcast(t[:1], n - 1), hvd.alltoall(even),
                received, splits, hvd.reducescatter(tf.ones([2 * n, 2])),
                hvd.grouped_allgather([t, t]))
    even = tf.range(n) + 10 * r
    gathered, root, a2a, received, splits, scattered, grouped = _mode(step, mode)(ragged, even)
    np.testing.assert_array_equal(gathered.numpy(),
                                  np.concatenate([_rank_rows(k, k + 1) for k in range(n)]))
    np.testing.assert_array_equal(root.numpy(), _rank_rows(n - 1, 1))
    np.testing.assert_array_equal(a2a.numpy(), [r + 10 * k for k in range(n)])
    np.testing.assert_array_equal(received.numpy(), a2a.numpy())
    assert splits.dtype == tf.int32 and list(splits.numpy()) == [1] * n
    np.testing.assert_array_equal(scattered.numpy(), np.ones([2, 2]))
    np.testing.assert_array_equal(grouped[1].numpy(), gathered.numpy())


@pytest.mark.parametrize("mode", MODES)
def test_gradients_follow_horovod_conventions(mode: str) -> None:
    """d/dw of allreduce, allgather and broadcast, with every rank's factor known."""
    r, n = hvd.rank(), hvd.size()
    w = tf.Variable([1.0, 2.0])

    def grads():  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            gathered = hvd.allgather(w * (r + 1))
            loss = (tf.reduce_sum(gathered ** 2) + tf.reduce_sum(hvd.broadcast(w, 0))
                    + tf.reduce_sum(hvd.allreduce(w * (r + 1))))
        return tape.gradient(loss, w)
    got = _mode(grads, mode)().numpy()
    wv = np.array([1.0, 2.0])
    # allgather: 2 * own rows (identical on every rank, so the average is itself) * (r+1)
    expected = 2 * wv * (r + 1) * (r + 1)
    expected += 1.0 if r == 0 else 0.0      # broadcast: root gets the mean, others zeros
    expected += r + 1                        # allreduce(Average) of ones, times (r+1)
    np.testing.assert_allclose(got, expected)


def test_inplace_ops_assign_variables_and_refuse_tensors() -> None:
    r, n = hvd.rank(), hvd.size()
    v = tf.Variable(np.full(3, float(r), np.float32))
    assert hvd.allreduce_(v, op=hvd.Sum) is v
    np.testing.assert_array_equal(v.numpy(), np.full(3, sum(range(n))))
    handle = hvd.broadcast_async_(v, n - 1, name="tf.bcast_")
    assert hvd.synchronize(handle) is v
    with pytest.raises(hvd.HvdliteTypeError, match="read-only"):
        hvd.allreduce_(tf.constant([1.0]), name="tf.immutable")

    @tf.function
    def in_graph() -> None:
        hvd.broadcast_(v, 0)
    v.assign(np.full(3, float(r), np.float32))
    in_graph()
    np.testing.assert_array_equal(v.numpy(), np.zeros(3))


def test_async_forms_are_eager_only() -> None:
    @tf.function
    def bad(t):  # type: ignore[no-untyped-def]
        return hvd.allreduce_async(t, name="tf.async_in_graph")
    with pytest.raises(hvd.HvdliteTypeError, match="eagerly"):
        bad(tf.constant([1.0]))
    hvd.barrier()


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_variables_makes_different_values_equal(mode: str) -> None:
    r = hvd.rank()
    variables = [tf.Variable(np.full([2, 2], r, np.float32)), tf.Variable(float(r) + 0.5)]

    def sync() -> None:
        hvd.broadcast_variables(variables, root_rank=0)
    _mode(sync, mode)()
    np.testing.assert_array_equal(variables[0].numpy(), np.zeros([2, 2]))
    assert float(variables[1].numpy()) == 0.5


def test_indexed_slices_are_reduced_by_allgather() -> None:
    r, n = hvd.rank(), hvd.size()
    slices = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r]),
                              dense_shape=tf.constant([n, 2]))
    reduced = hvd.allreduce(slices, op=hvd.Average)
    assert isinstance(reduced, tf.IndexedSlices)
    dense = tf.convert_to_tensor(reduced).numpy()
    np.testing.assert_allclose(dense[:, 0], [(k + 1) / n for k in range(n)])


def test_variables_that_differ_across_ranks_raise_mismatch_everywhere() -> None:
    r = hvd.rank()
    variables = [tf.Variable(tf.zeros([2])), tf.Variable(tf.zeros([3 + r]), name="odd")]
    with pytest.raises(hvd.MismatchError, match="odd"):
        hvd.broadcast_variables(variables, root_rank=0)
    extra = variables[:1] + ([tf.Variable(1.0)] if r == 0 else [])
    with pytest.raises(hvd.MismatchError, match="counts|no such variable"):
        hvd.broadcast_variables(extra, root_rank=0)


def test_not_a_tensor_is_a_type_error_on_every_rank() -> None:
    with pytest.raises(hvd.HvdliteTypeError, match="tf.Tensor"):
        hvd.allreduce(1.5, name="tf.not_a_tensor")
    with pytest.raises(hvd.HvdliteTypeError, match="GradientTape"):
        hvd.DistributedGradientTape(object())


def test_exports_every_runtime_name() -> None:
    import hvdlite
    missing = [n for n in hvdlite.__all__ if n not in ("COMMON_NAMES", "__version__")
               and n not in hvd.__all__]
    assert not missing and all(hasattr(hvd, n) for n in hvd.__all__)


def test_collectives_in_a_jit_compiled_function_raise_xla_compile_error() -> None:
    """XLA cannot compile a collective: a clear error when the function is traced,
    on every rank, naming the op; nothing is submitted, so nothing hangs."""
    x = tf.ones([2 * hvd.size(), 2])
    cases = {"allreduce": lambda t: hvd.allreduce(t), "allgather": lambda t: hvd.allgather(t),
             "reducescatter": lambda t: hvd.reducescatter(t),
             "alltoall": lambda t: hvd.alltoall(t),
             "broadcast": lambda t: hvd.broadcast(t, 0)}
    for op, body in cases.items():
        with pytest.raises(hvd.XlaCompileError, match=rf"hvdlite\.tensorflow\.{op} cannot run "
                           r"inside tf\.function\(jit_compile=True\).*jit_compile=False"):
            tf.function(body, jit_compile=True)(x)
    variable = tf.Variable(tf.ones([2]))

    @tf.function(jit_compile=True)
    def step():  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable * 2.0)
        return hvd.DistributedGradientTape(tape).gradient(loss, [variable])
    with pytest.raises(hvd.XlaCompileError, match=r"DistributedGradientTape\.gradient"):
        step()
    assert issubclass(hvd.XlaCompileError, hvd.UsageError)
    summed = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))(x)   # jit_compile off: runs
    np.testing.assert_array_equal(summed.numpy(), hvd.size() * np.ones([2 * hvd.size(), 2]))
