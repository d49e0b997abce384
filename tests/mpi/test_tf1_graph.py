"""TF1 graphs run by a Session: the in-place collectives on variables, and the
broadcast of the global variables, must take effect when what they return is run.

A TF1 graph runs only what a fetched tensor depends on. The in-place forms once
built an assignment nothing depended on and returned the variable: every rank but
the root kept its own value, silently (Horovod's own test_tensorflow.py graph-mode
``broadcast_inplace`` tests found it)."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip(
    "tensorflow", reason="TensorFlow is not installed in this venv (make test's Open MPI venv, .venv-ompi, has NumPy and torch only)")

import hvdlite.tensorflow as hvd  # noqa: E402

DTYPES = [tf.uint8, tf.int64, tf.float16, tf.float64]


def _session_graph():  # type: ignore[no-untyped-def]
    graph = tf.Graph()
    return graph, tf.compat.v1.Session(graph=graph)


def _variable(value: np.ndarray, resource: bool):  # type: ignore[no-untyped-def]
    return tf.compat.v1.Variable(value, use_resource=resource)


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_broadcast_inplace_list_takes_the_roots_values(dtype, resource: bool) -> None:  # type: ignore[no-untyped-def]
    r, n = hvd.rank(), hvd.size()
    graph, sess = _session_graph()
    with graph.as_default(), sess:
        shapes = [(17,), (3, 5), (0,), (2, 1, 3)]
        variables = [_variable(np.full(s, r, dtype.as_numpy_dtype), resource) for s in shapes]
        for root in sorted({0, n - 1}):
            sess.run(tf.compat.v1.global_variables_initializer())   # every rank its own again
            new_values = hvd.broadcast_(variables, root)
            for value, fetched, shape in zip(new_values, sess.run(new_values), shapes):
                assert value.dtype.base_dtype == dtype
                np.testing.assert_array_equal(fetched, np.full(shape, root),
                                              err_msg=f"rank {r} root {root}")
            for variable, shape in zip(variables, shapes):
                np.testing.assert_array_equal(sess.run(variable), np.full(shape, root))


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_single_variable_inplace_forms_run_when_fetched(resource: bool) -> None:
    r, n = hvd.rank(), hvd.size()
    graph, sess = _session_graph()
    with graph.as_default(), sess:
        summed = _variable(np.full(5, r + 1, np.float64), resource)
        root_value = _variable(np.full(3, r, np.float32), resource)
        group = [_variable(np.full(4, r, np.float32), resource),
                 _variable(np.full(2, 2 * r, np.int32), resource)]
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.allreduce_(summed, op=hvd.Sum))
        np.testing.assert_array_equal(sess.run(summed), np.full(5, n * (n + 1) / 2))
        fetched = sess.run(hvd.broadcast_(root_value, n - 1))
        np.testing.assert_array_equal(fetched, np.full(3, n - 1))
        np.testing.assert_array_equal(sess.run(root_value), np.full(3, n - 1))
        sess.run(hvd.grouped_allreduce_(group, op=hvd.Sum))
        total = n * (n - 1) / 2
        np.testing.assert_array_equal(sess.run(group[0]), np.full(4, total))
        np.testing.assert_array_equal(sess.run(group[1]), np.full(2, 2 * total))


def test_broadcast_global_variables_op_and_hook() -> None:
    r, n = hvd.rank(), hvd.size()
    graph, sess = _session_graph()
    with graph.as_default(), sess:
        weights = tf.compat.v1.get_variable("weights", initializer=np.full(6, r, np.float32))
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_global_variables(n - 1))
        np.testing.assert_array_equal(sess.run(weights), np.full(6, n - 1))
    with tf.Graph().as_default():
        bias = tf.compat.v1.get_variable("bias", initializer=np.full(2, r + 5, np.float32))
        step = tf.compat.v1.train.get_or_create_global_step()
        hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        with tf.compat.v1.train.MonitoredSession(hooks=hooks) as monitored:
            np.testing.assert_array_equal(monitored.run(bias), np.full(2, 5.0))
            assert monitored.run(step) == 0


def test_tf_function_inplace_forms_still_return_the_variable() -> None:
    r, n = hvd.rank(), hvd.size()
    variable = tf.Variable(np.full(3, r, np.float32))

    @tf.function
    def step():  # type: ignore[no-untyped-def]
        out = hvd.broadcast_(variable, 0)
        return out is variable
    assert step()
    np.testing.assert_array_equal(variable.numpy(), np.zeros(3))
