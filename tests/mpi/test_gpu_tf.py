"""TensorFlow GPU tensors through hvdlite.tensorflow: results stay on the GPU,
eager and inside tf.function, every collective, in-place ops on GPU variables,
immutable GPU tensors refused in place on every rank, and DistributedGradientTape
equivalence on the GPU.

Needs TensorFlow built with CUDA, a GPU it can see, and CuPy; elsewhere (CI, and
the project's GPU machine, whose image has no TensorFlow) every test skips with
the reason. Size-agnostic.
"""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed here")
if not tf.config.list_physical_devices("GPU"):
    pytest.skip("TensorFlow sees no GPU here (GPU tests run on a GPU machine with a CUDA "
                "build of TensorFlow)", allow_module_level=True)
pytest.importorskip("cupy", reason="GPU tensors need CuPy (pip install hvdlite[cuda12])")

import hvdlite.tensorflow as hvd  # noqa: E402
from hvdlite.errors import HvdliteTypeError  # noqa: E402

MODES = ["eager", "function"]


@pytest.fixture(scope="module", autouse=True)
def _one_gpu_per_rank() -> None:
    gpus = tf.config.list_physical_devices("GPU")
    tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")


def _on_gpu(tensor: "tf.Tensor") -> bool:
    return "GPU" in tensor.device.upper()


def _mode(fn, mode: str):  # type: ignore[no-untyped-def]
    return fn if mode == "eager" else tf.function(fn)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.float16, tf.int32])
def test_allreduce_of_gpu_tensors_stays_on_the_gpu(mode: str, dtype: "tf.DType") -> None:
    rank, size = hvd.rank(), hvd.size()
    with tf.device("/GPU:0"):
        x = tf.cast(tf.fill([1000], rank + 1), dtype)
        total, biggest = _mode(lambda t: (hvd.allreduce(t, op=hvd.Sum, name=f"tfgpu.sum.{mode}"),
                                          hvd.allreduce(t, op=hvd.Max, name=f"tfgpu.max.{mode}")),
                               mode)(x)
    if mode == "eager" and dtype != tf.int32:     # TensorFlow keeps int32 in host memory
        assert _on_gpu(total)
    np.testing.assert_array_equal(total.numpy(), np.full(1000, size * (size + 1) // 2))
    np.testing.assert_array_equal(biggest.numpy(), np.full(1000, size))


def test_gather_broadcast_alltoall_reducescatter_on_the_gpu() -> None:
    rank, size = hvd.rank(), hvd.size()
    with tf.device("/GPU:0"):
        rows = tf.fill([rank + 1, 2], float(rank))
        gathered = hvd.allgather(rows, name="tfgpu.gather")
        root = hvd.broadcast(tf.constant([rank, 7.0]), size - 1, name="tfgpu.bcast")
        swapped = hvd.alltoall(tf.cast(tf.range(size) + 10 * rank, tf.float32), name="tfgpu.a2a")
        scattered = hvd.reducescatter(tf.ones([2 * size, 3]), op=hvd.Sum, name="tfgpu.rs")
    assert all(_on_gpu(t) for t in (gathered, root, swapped, scattered))
    expected = np.concatenate([np.full((r + 1, 2), float(r)) for r in range(size)])
    np.testing.assert_array_equal(gathered.numpy(), expected)
    np.testing.assert_array_equal(root.numpy(), [size - 1, 7.0])
    np.testing.assert_array_equal(swapped.numpy(), [rank + 10 * k for k in range(size)])
    np.testing.assert_array_equal(scattered.numpy(), np.full((2, 3), float(size)))


def test_in_place_ops_write_gpu_variables_and_refuse_gpu_tensors() -> None:
    rank, size = hvd.rank(), hvd.size()
    with tf.device("/GPU:0"):
        variable = tf.Variable(tf.fill([4], float(rank)))
        frozen = tf.fill([4], float(rank))
    hvd.allreduce_(variable, op=hvd.Sum, name="tfgpu.inplace")
    np.testing.assert_array_equal(variable.numpy(), np.full(4, float(sum(range(size)))))
    with pytest.raises(HvdliteTypeError, match="read-only"):
        hvd.allreduce_(frozen, name="tfgpu.frozen")       # every rank refuses it alike


def test_gradient_tape_on_the_gpu_equals_one_process_on_the_whole_batch() -> None:
    rank, size = hvd.rank(), hvd.size()
    data = np.random.default_rng(0).normal(size=(8 * size, 5))
    target = data @ np.arange(1.0, 6.0)

    def fit(x: np.ndarray, y: np.ndarray, distributed: bool) -> np.ndarray:
        with tf.device("/GPU:0"):
            w = tf.Variable(tf.zeros([5], tf.float64))
            opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
            for _ in range(5):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((tf.linalg.matvec(x, w) - y) ** 2)
                if distributed:
                    tape = hvd.DistributedGradientTape(tape)
                opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return w.numpy()

    mine = slice(8 * rank, 8 * (rank + 1))
    distributed = fit(data[mine], target[mine], True)
    single = fit(data, target, False)
    np.testing.assert_allclose(distributed, single, rtol=0, atol=1e-10)
    everyone = hvd.allgather_object(distributed.tobytes(), name="tfgpu.identical")
    assert len(set(everyone)) == 1
