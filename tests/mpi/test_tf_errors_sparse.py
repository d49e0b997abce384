"""hvdlite.tensorflow where Horovod's own TensorFlow suite found gaps: errors that
are both hvdlite's and TensorFlow's, tf.IndexedSlices (scaling refused, grouped and
mixed lists), the gradient of grouped_allgather, the rank and size ops, and the
list form of broadcast_."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip(
    "tensorflow", reason="TensorFlow is not installed in this venv (make test's Open MPI venv, "
    ".venv-ompi, has NumPy and torch only)")
tf.config.threading.set_intra_op_parallelism_threads(1)

import hvdlite.tensorflow as hvd  # noqa: E402

pytestmark = pytest.mark.skipif("hvd.size() == 1", reason="mismatches need two ranks")


def _per_rank(base: list[int]) -> list[int]:
    return [b + hvd.rank() for b in base]


@pytest.mark.parametrize("call", [
    lambda r: hvd.allreduce(tf.ones([17 + r, 3])),
    lambda r: hvd.allreduce(tf.ones([4], dtype=tf.int32 if r % 2 else tf.float32)),
    lambda r: hvd.allgather(tf.ones([2, 3 + r])),
    lambda r: hvd.broadcast(tf.ones([3]), root_rank=r % 2),
    lambda r: hvd.alltoall(tf.ones([2 * hvd.size(), 1 + r])),
    lambda r: hvd.reducescatter(tf.ones([2 * hvd.size(), 1 + r])),
], ids=["shape", "dtype", "allgather_shape", "root", "alltoall_shape", "reducescatter_shape"])
def test_ranks_that_disagree_raise_mismatch_and_failed_precondition(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(hvd.MismatchError) as raised:
        call(hvd.rank())
    assert isinstance(raised.value, tf.errors.FailedPreconditionError)
    assert raised.value.message == str(raised.value) and "Mismatched" in str(raised.value)
    assert type(raised.value).__name__ == "MismatchError"


def test_bad_arguments_raise_usage_error_and_invalid_argument() -> None:
    for bad in (lambda: hvd.alltoall(tf.ones([hvd.size() + 1])),
                lambda: hvd.alltoall(tf.ones([3]), splits=[1] * (hvd.size() + 1))):
        with pytest.raises(hvd.UsageError) as raised:
            bad()
        assert isinstance(raised.value, tf.errors.InvalidArgumentError)
        assert isinstance(raised.value, ValueError)


def _slices(rows: int = 1) -> tf.IndexedSlices:
    r = hvd.rank()
    values = tf.constant(np.full((rows, 3), r + 1.0, np.float32))
    return tf.IndexedSlices(values, tf.constant([r] * rows, tf.int64), tf.constant([8, 3]))


@pytest.mark.parametrize("op", ["Min", "Max", "Product", "Adasum"])
def test_sparse_reduction_other_than_average_or_sum_is_not_implemented(op: str) -> None:
    for call in (lambda: hvd.allreduce(_slices(), op=getattr(hvd, op)),
                 lambda: hvd.grouped_allreduce([_slices(), tf.ones([2])], op=getattr(hvd, op)),
                 lambda: tf.function(lambda: hvd.allreduce(_slices(), op=getattr(hvd, op)))()):
        with pytest.raises(NotImplementedError, match="op=Average or Sum only") as raised:
            call()
        assert isinstance(raised.value, hvd.NotSupportedError)
        assert isinstance(raised.value, tf.errors.UnimplementedError)


@pytest.mark.parametrize("scale", [{"prescale_factor": 2.0}, {"postscale_factor": 3.0}])
def test_sparse_scale_factors_are_refused_not_ignored(scale: dict) -> None:
    with pytest.raises(NotImplementedError, match="prescale_factor and postscale_factor"):
        hvd.allreduce(_slices(), op=hvd.Sum, **scale)
    with pytest.raises(NotImplementedError, match="prescale_factor and postscale_factor"):
        hvd.grouped_allreduce([tf.ones([2]), _slices()], op=hvd.Sum, **scale)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("op", ["Average", "Sum"])
def test_grouped_and_mixed_lists_keep_their_order(mode: str, op: str) -> None:
    n = hvd.size()
    dense = tf.fill([2], float(hvd.rank() + 1))

    def step():  # type: ignore[no-untyped-def]
        return hvd.grouped_allreduce([_slices(2), dense, _slices(1)], op=getattr(hvd, op))
    first, middle, last = step() if mode == "eager" else tf.function(step)()
    divide = n if op == "Average" else 1
    total = sum(range(1, n + 1))
    np.testing.assert_allclose(middle.numpy(), np.full([2], total / divide), rtol=1e-6)
    for result, rows in ((first, 2), (last, 1)):
        assert isinstance(result, tf.IndexedSlices)
        want = np.concatenate([np.full((rows, 3), (k + 1.0) / divide) for k in range(n)])
        np.testing.assert_allclose(result.values.numpy(), want, rtol=1e-6)
        np.testing.assert_array_equal(result.indices.numpy(),
                                      np.repeat(np.arange(n), rows))


def test_unnamed_ops_on_captured_tensors_pair_up_when_ranks_made_different_tensors() -> None:
    """TF names a captured eager tensor by its id, which counts the tensors the process
    made: the derived op name must not depend on it (it differed, and the ranks waited
    on differently named reductions until the stall timeout)."""
    _ = [tf.ones([1]) for _ in range(3 * hvd.rank() + 1)]      # a different count a rank
    captured = tf.fill([2], float(hvd.rank() + 1))

    @tf.function
    def step():  # type: ignore[no-untyped-def]
        return hvd.grouped_allreduce([captured, tf.ones([3])], op=hvd.Sum)
    first, second = step()
    total = sum(range(1, hvd.size() + 1))
    np.testing.assert_allclose(first.numpy(), np.full([2], total))
    np.testing.assert_allclose(second.numpy(), np.full([3], hvd.size()))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_grouped_allgather_gradient_is_the_ranks_mean_of_its_rows(mode: str) -> None:
    r, n = hvd.rank(), hvd.size()
    rows = [k + 1 for k in range(n)]
    xs = [tf.Variable(tf.ones([rows[r], 2]) * (i + 1)) for i in range(3)]

    def step():  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            gathered = hvd.grouped_allgather(xs)
            # Each rank weighs the gathered rows by (its rank + 1) * (tensor + 1).
            loss = tf.add_n([tf.reduce_sum(g) * (r + 1) * (i + 1) for i, g in enumerate(gathered)])
        return tape.gradient(loss, xs)
    grads = step() if mode == "eager" else tf.function(step)()
    mean_weight = sum(k + 1 for k in range(n)) / n
    for i, grad in enumerate(grads):
        np.testing.assert_allclose(grad.numpy(), np.full([rows[r], 2], mean_weight * (i + 1)),
                                   rtol=1e-6)


def test_rank_and_size_ops_eagerly_and_when_the_graph_runs() -> None:
    expected = [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), 1]

    def ops():  # type: ignore[no-untyped-def]
        return [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op(),
                hvd.process_set_included_op()]
    for values in (ops(), tf.function(ops)()):
        assert [int(v) for v in values] == expected
        assert all(v.dtype == tf.int32 for v in values)
    odd = hvd.ProcessSet([k for k in range(hvd.size()) if k % 2])
    hvd.add_process_set(odd)
    try:
        assert int(hvd.size_op(odd.process_set_id)) == odd.size()
        assert int(hvd.process_set_included_op(odd.process_set_id)) == hvd.rank() % 2
    finally:
        hvd.remove_process_set(odd)
    with pytest.raises(hvd.UsageError, match="no process set with id 99"):
        hvd.size_op(99)


def test_broadcast_list_of_variables_in_place() -> None:
    root = hvd.size() - 1
    variables = [tf.Variable(tf.fill([3], float(hvd.rank()))), tf.Variable(hvd.rank() + 10)]
    values = hvd.broadcast_(variables, root_rank=root, name="bcast.list")
    assert [v.numpy().tolist() for v in values] == [[float(root)] * 3, root + 10]
    assert [v.numpy().tolist() for v in variables] == [[float(root)] * 3, root + 10]

    @tf.function
    def in_graph():  # type: ignore[no-untyped-def]
        return hvd.broadcast_(variables, root_rank=0)
    variables[0].assign(tf.fill([3], float(hvd.rank())))
    assert in_graph()[0].numpy().tolist() == [0.0] * 3


def test_eager_broadcast_global_variables_names_the_tf2_way() -> None:
    assert hvd._executing_eagerly()
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)


def test_a_mismatch_while_a_traced_function_runs_names_the_hvdlite_class() -> None:
    """Inside a running graph TensorFlow picks the class (see hvdlite.tensorflow.errors);
    the message still names hvdlite's error and the rank."""
    @tf.function
    def reduce(x):  # type: ignore[no-untyped-def]
        return hvd.allreduce(x, name="traced.mismatch")
    with pytest.raises(tf.errors.UnknownError, match=r"MismatchError: rank \d+: Mismatched shape"):
        reduce(tf.ones([3 + hvd.rank()]))
