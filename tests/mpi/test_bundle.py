"""Grouped allreduces whose small CPU tensors of one dtype travel as one bundled
request (hvdlite/api/bundle.py): the same results as one by one, in order, for
every form and binding, and a clear error on every rank where ranks disagree."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import hvdlite as hvd
import hvdlite.torch as hvdt
from hvdlite.api.bundle import BUNDLED_BELOW
from tests.mpi.conftest import rank_data

SHAPES = [(3, 4), (), (0,), (7,), (2, 1, 5)]     # a scalar and an empty tensor included
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]


def _group(dtype: type, salt: int) -> list[np.ndarray]:
    return [np.asarray(rank_data(hvd.rank(), shape, dtype, salt + i))     # () -> a 0-d array
            for i, shape in enumerate(SHAPES)]


def _one_by_one(tensors: list[np.ndarray], name: str, **kwargs: object) -> list[np.ndarray]:
    handles = [hvd.allreduce_async(t, name=f"{name}.alone.{i}", **kwargs)
               for i, t in enumerate(tensors)]
    return [hvd.synchronize(h) for h in handles]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("op", OPS, ids=lambda o: hvd.ReduceOp(o).name)
def test_bundled_results_equal_one_by_one_bitwise(op: int, dtype: type) -> None:
    if op == hvd.Product and hvd.size() > 4:
        pytest.skip("values up to 3**size would overflow")
    name = f"bundle.eq.{hvd.ReduceOp(op).name}.{np.dtype(dtype).name}"
    tensors = _group(dtype, 10 * int(op))
    bundled = hvd.grouped_allreduce(tensors, op=op, name=name)
    alone = _one_by_one(tensors, name, op=op)
    inplace = [t.copy() for t in tensors]
    returned = hvd.grouped_allreduce_(inplace, op=op, name=f"{name}.inplace")
    assert len(bundled) == len(tensors) == len(returned)
    for i, (got, want, done, target) in enumerate(zip(bundled, alone, returned, inplace)):
        assert got.shape == want.shape == SHAPES[i] and got.dtype == want.dtype, i
        np.testing.assert_array_equal(got, want, err_msg=f"tensor {i}")
        assert done is target                          # in place: the caller's own arrays
        np.testing.assert_array_equal(target, want, err_msg=f"in place, tensor {i}")


def test_scales_and_large_tensors_keep_their_order() -> None:
    """Tensors of BUNDLED_BELOW bytes or more go alone, between bundled ones; the
    results still come back in the order given, each scaled as asked."""
    rank, big = hvd.rank(), BUNDLED_BELOW // 8
    factors = [1.0, 2.0, 3.0, 4.0]
    shapes = [(3,), (big,), (2, 2), (big + 1,)]
    tensors = [np.full(shape, f * (rank + 1)) for shape, f in zip(shapes, factors)]
    n = sum(r + 1 for r in range(hvd.size()))
    results = hvd.synchronize(hvd.grouped_allreduce_async(
        tensors, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="bundle.big"))
    assert [r.shape for r in results] == shapes
    for result, factor in zip(results, factors):
        np.testing.assert_array_equal(result, np.full(result.shape, factor * n))


def test_torch_tensors_in_place_with_strides_and_allocating() -> None:
    rank, size = hvd.rank(), hvd.size()
    n = float(sum(r + 1 for r in range(size)))
    base = torch.full((4, 3), float(rank + 1))
    targets = [base.t(), torch.full((5,), float(rank + 1)), torch.tensor(float(rank + 1))]
    returned = hvdt.grouped_allreduce_(targets, op=hvd.Sum, name="bundle.torch.inplace")
    assert all(r is t for r, t in zip(returned, targets))
    assert torch.equal(base, torch.full((4, 3), n))    # written through the transposed view
    for target in targets[1:]:
        assert torch.equal(target, torch.full(target.shape, n))
    results = hvdt.grouped_allreduce([torch.ones(2, 2) * (rank + 1), torch.ones(3)],
                                     op=hvd.Average, name="bundle.torch")
    assert [tuple(r.shape) for r in results] == [(2, 2), (3,)]
    assert all(isinstance(r, torch.Tensor) for r in results)
    assert torch.equal(results[0], torch.full((2, 2), n / size))
    assert torch.equal(results[1], torch.ones(3))


def _outcome(call) -> str:  # type: ignore[no-untyped-def]
    try:
        call()
    except hvd.HvdliteError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _after_error_collectives_work(name: str) -> None:
    total = hvd.allreduce(np.ones(2), op=hvd.Sum, name=f"{name}.after")
    np.testing.assert_array_equal(total, np.full(2, float(hvd.size())))


@pytest.mark.timeout(60)
def test_shapes_that_differ_between_ranks_fail_on_every_rank() -> None:
    """Same count, dtype and total size, but the shapes come in another order on
    rank 0: each rank's bundle alone looks fine; negotiation must refuse it."""
    shapes = [(2, 3), (4,)] if hvd.rank() == 0 else [(4,), (2, 3)]
    outcome = _outcome(lambda: hvd.grouped_allreduce([np.ones(s) for s in shapes],
                                                     name="bundle.shapes"))
    outcomes = hvd.allgather_object(outcome, name="bundle.shapes.outcomes")
    if hvd.size() > 1:
        for text in outcomes:
            assert "MismatchError" in text and "bundle.shapes.0" in text, text
            assert "shapes of the grouped tensors bundled" in text, text
    _after_error_collectives_work("bundle.shapes")


@pytest.mark.timeout(60)
def test_a_bad_tensor_on_one_rank_fails_the_bundle_on_every_rank() -> None:
    """Rank 0 passes a read-only target to the in-place form: it raises at once and
    the others raise too, naming rank 0, instead of waiting for it."""
    targets = [np.ones(3), np.ones(2)]
    if hvd.rank() == 0:
        targets[1].setflags(write=False)
    outcome = _outcome(lambda: hvd.grouped_allreduce_(targets, name="bundle.readonly"))
    outcomes = hvd.allgather_object(outcome, name="bundle.readonly.outcomes")
    assert "read-only" in outcomes[0], outcomes[0]
    for text in outcomes[1:]:
        assert "invalid arguments on ranks [0]" in text and "read-only" in text, text
    _after_error_collectives_work("bundle.readonly")


def test_a_joined_rank_contributes_zeros_to_a_bundle() -> None:
    """Assert only after join(): a rank failing before it would leave the others waiting."""
    rank, size = hvd.rank(), hvd.size()
    results = None
    if rank != size - 1 or size == 1:
        results = hvd.grouped_allreduce([np.full(3, 1.0), np.full((2, 2), 2.0)], op=hvd.Sum,
                                        name="bundle.join")
    hvd.join()
    if results is not None:
        active = size - 1 if size > 1 else 1
        np.testing.assert_array_equal(results[0], np.full(3, float(active)))
        np.testing.assert_array_equal(results[1], np.full((2, 2), 2.0 * active))


def test_a_bundle_on_a_process_set_averages_over_its_members() -> None:
    rank, size = hvd.rank(), hvd.size()
    evens = hvd.add_process_set(range(0, size, 2))
    try:
        if evens.included():
            results = hvd.grouped_allreduce([np.full(3, float(rank)), np.full((2,), 1.0)],
                                            op=hvd.Average, process_set=evens,
                                            name="bundle.set")
            members = list(range(0, size, 2))
            np.testing.assert_array_equal(results[0], np.full(3, sum(members) / len(members)))
            np.testing.assert_array_equal(results[1], np.ones(2))
    finally:
        hvd.remove_process_set(evens)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["bundled", "per_tensor"])
def test_a_refused_tensor_fails_the_ones_after_it_on_every_rank(path: str) -> None:
    """Rank 0 refuses one submission of the group (a read-only in-place target): the
    submissions after it never reach rank 0's engine, so rank 0 marks them failed and
    every other rank's handles for them raise instead of waiting for ever."""
    if hvd.size() == 1:
        pytest.skip("needs a peer")
    big = np.ones(BUNDLED_BELOW // 8)                  # goes alone, after the bundle
    other = np.float32 if path == "per_tensor" else np.float64   # two dtypes: no bundle
    tensors = [np.ones(3), np.ones(2), big, np.ones(4, dtype=other)]
    if hvd.rank() == 0:
        tensors[1].setflags(write=False)
    name = f"bundle.refused.{path}"
    outcomes: list[str] = []
    try:
        handle = hvd.grouped_allreduce_async_(tensors, name=name)
    except hvd.HvdliteError as error:
        outcomes.append(f"refused: {error}")
    else:
        for one in handle.handles:
            outcomes.append(_outcome(lambda one=one: hvd.synchronize(one)))
    everywhere = hvd.allgather_object(outcomes, name=f"{name}.outcomes")
    assert everywhere[0] and "read-only" in everywhere[0][0], everywhere[0]
    for outcomes in everywhere[1:]:
        assert outcomes[-1].startswith("HvdliteTypeError") or "invalid arguments on ranks [0]" \
            in outcomes[-1], outcomes
    _after_error_collectives_work(name)
