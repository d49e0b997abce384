"""The check that ranks train the same variables compares what the collectives need
(count, shape, dtype), and names the variable without requiring the names to agree."""
from __future__ import annotations

from hvdlite.api.variable_check import describe_difference


def test_names_may_differ_between_ranks_shapes_dtypes_and_counts_not() -> None:
    # Horovod's resume pattern: rank 0 loads the model from a file, the others build it;
    # Keras names the loaded Sequential's variables without the 'sequential/' prefix.
    loaded = [("conv2d/kernel", (3, 3, 3, 8), "float32"), ("sgd/iteration", (), "int64")]
    built = [("sequential/conv2d/kernel", (3, 3, 3, 8), "float32"),
             ("sgd/iteration", (), "int64")]
    assert describe_difference([loaded, built, built]) is None
    # A difference in shape, dtype or count still fails, naming the variable.
    one = [("dense/kernel", (4, 2), "float32")]
    assert describe_difference([one, [("dense_1/kernel", (4, 3), "float32")]]) == (
        "variable #0 differs: ranks [0] have 'dense/kernel' shape=(4, 2) dtype=float32; "
        "ranks [1] have 'dense_1/kernel' shape=(4, 3) dtype=float32")
    assert "ranks [1] have 'k' shape=(4, 2) dtype=float64" in describe_difference(
        [one, [("k", (4, 2), "float64")]])
    assert describe_difference([one, []]) == (
        "variable #0 differs: ranks [0] have 'dense/kernel' shape=(4, 2) dtype=float32; "
        "ranks [1] have no such variable")


def test_whether_a_variable_trains_is_compared_and_named() -> None:
    """Two layers of one shape, each rank freezing a different one: the shapes alone
    agree, the fourth field (trained or frozen) does not."""
    first = [("0.weight", (4, 4), "float64", False), ("1.weight", (4, 4), "float64", True)]
    second = [("0.weight", (4, 4), "float64", True), ("1.weight", (4, 4), "float64", False)]
    assert describe_difference([first, first]) is None
    assert describe_difference([first, second]) == (
        "variable #0 differs: ranks [0] have '0.weight' shape=(4, 4) dtype=float64 frozen; "
        "ranks [1] have '0.weight' shape=(4, 4) dtype=float64 trainable")
