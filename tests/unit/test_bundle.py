"""Which tensors of a grouped allreduce are bundled into one request (no MPI):
only what every rank must agree on decides it, and a doubtful case is left to
the per-tensor path, which names what is wrong."""
from __future__ import annotations

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.api.adapter import NUMPY
from hvdlite.api.bundle import BUNDLED_BELOW, small_items
from hvdlite.negotiation.coordinator import find_mismatch
from hvdlite.negotiation.requests import Descriptor, Kind

BIG = BUNDLED_BELOW // 4          # float32 elements of a tensor that goes alone


def test_small_tensors_of_one_dtype_are_bundled_and_large_ones_go_alone() -> None:
    tensors = [np.ones(3, np.float32), np.ones(BIG, np.float32), np.ones((), np.float32),
               np.ones(BIG - 1, np.float32)]
    small = small_items(NUMPY, tensors, hvd.Sum, None)
    assert list(small) == [0, 2, 3]
    assert all(small[i].array.shape == tensors[i].shape for i in small)


@pytest.mark.parametrize("case", ["one", "one_small", "two_dtypes", "adasum", "not_tensor",
                                  "bad_op", "unsupported_dtype"])
def test_groups_that_are_not_bundled(case: str) -> None:
    pair = [np.ones(3, np.float32), np.ones(2, np.float32)]
    tensors, op = {
        "one": ([pair[0]], hvd.Sum),
        "one_small": ([pair[0], np.ones(BIG, np.float32)], hvd.Sum),
        "two_dtypes": ([pair[0], np.ones(2, np.float64)], hvd.Sum),
        "adasum": (pair, hvd.Adasum),             # not elementwise: per tensor
        "not_tensor": (pair + [[1.0, 2.0]], hvd.Sum),
        "bad_op": (pair, 99),
        "unsupported_dtype": ([np.array(["a"]), np.array(["b"])], hvd.Sum),
    }[case]
    assert small_items(NUMPY, tensors, op, None) == {}


def test_a_large_tensor_of_another_dtype_keeps_the_group_per_tensor() -> None:
    tensors = [np.ones(3, np.float32), np.ones(2, np.float32), np.ones(BIG, np.float64)]
    assert small_items(NUMPY, tensors, hvd.Sum, None) == {}


def test_bundled_shapes_are_compared_across_ranks() -> None:
    def bundle(parts: tuple) -> Descriptor:
        return Descriptor("g.0", Kind.ALLREDUCE, dtype="float32", shape=(10,), parts=parts)
    assert find_mismatch({0: bundle(((2, 3), (4,))), 1: bundle(((2, 3), (4,)))}) is None
    message = find_mismatch({0: bundle(((2, 3), (4,))), 1: bundle(((4,), (2, 3)))})
    assert message is not None and "'g.0'" in message
    assert "shapes of the grouped tensors bundled" in message and "(4,), (2, 3)" in message


def test_gpu_tensors_are_not_bundled_nor_converted() -> None:
    """Converting a GPU tensor records a CUDA event: the decision comes first."""
    class OnGpu(type(NUMPY)):   # type: ignore[misc]
        converted = 0

        def device(self, tensor: object) -> str:
            return "cuda:0"

        def to_array(self, tensor: object) -> np.ndarray:
            OnGpu.converted += 1
            return super().to_array(tensor)
    assert small_items(OnGpu(), [np.ones(3, np.float32), np.ones(2, np.float32)],
                       hvd.Sum, None) == {}
    assert OnGpu.converted == 0
