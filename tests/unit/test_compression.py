"""Which tensors Compression.fp16/bf16 cast for the wire, and how they come back
(NumPy arrays; the torch and TF adapters cast the same way, tested under MPI)."""
import ml_dtypes
import numpy as np
import pytest

from hvdlite.api.compression import Compression, compressed, compressed_all
from hvdlite.errors import HvdliteTypeError

WIRE = {"fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
LEFT_ALONE = [np.float16, ml_dtypes.bfloat16, np.int8, np.int32, np.int64, np.bool_]


def _forms(name: str) -> list:
    compressor = getattr(Compression, name)
    return [compressor, compressor()]         # Horovod scripts use the class; an instance works too


@pytest.mark.parametrize("name", sorted(WIRE))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_wide_floats_travel_in_16_bits_and_come_back(name: str, dtype: type) -> None:
    for compressor in _forms(name):
        tensor = np.array([1.5, -2.25, 3.0], dtype=dtype)
        wire, context = compressor.compress(tensor)
        assert wire.dtype == WIRE[name] and context is not None
        restored = compressor.decompress(wire, context)
        assert restored.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(restored, tensor)   # these values are exact in 16 bits


@pytest.mark.parametrize("name", sorted(WIRE) + ["none"])
@pytest.mark.parametrize("dtype", LEFT_ALONE)
def test_small_and_integer_tensors_are_left_alone(name: str, dtype: type) -> None:
    for compressor in _forms(name):
        tensor = np.ones(4, dtype=dtype)
        wire, context = compressor.compress(tensor)
        assert wire is tensor and context is None
        assert compressor.decompress(wire, context) is tensor


def test_none_leaves_wide_floats_alone() -> None:
    for compressor in _forms("none"):
        tensor = np.ones(3, dtype=np.float64)
        assert compressor.compress(tensor) == (tensor, None)


@pytest.mark.parametrize("name", sorted(WIRE))
def test_a_non_tensor_is_refused(name: str) -> None:
    with pytest.raises(HvdliteTypeError, match="cannot compress a list"):
        getattr(Compression, name).compress([1.0, 2.0])


def test_helpers_hand_the_wire_form_to_the_collective_and_restore_the_result() -> None:
    seen = []

    def run(wire: np.ndarray) -> np.ndarray:
        seen.append(wire.dtype)
        return wire * 2
    result = compressed(Compression.fp16, np.array([1.0, 2.0], dtype=np.float32), run)
    assert seen == [np.float16] and result.dtype == np.float32
    np.testing.assert_array_equal(result, [2.0, 4.0])
    group = compressed_all(Compression.bf16, [np.ones(2, np.float64), np.ones(2, np.int32)],
                           lambda wires: [w + 1 for w in wires])
    assert [g.dtype for g in group] == [np.float64, np.int32]
    np.testing.assert_array_equal(group[0], [2.0, 2.0])
    assert compressed(None, np.ones(1, np.float32), lambda w: w).dtype == np.float32
