"""The torch DistributedOptimizer's gradient buckets (from the first step;
HVDLITE_BUCKET_BYTES=0 gives each gradient a bucket of its own): N ranks on 1/N of
each batch match one process on the whole batch and one bucket per gradient,
every rank holds bitwise identical parameters, ``.grad`` is a view of its
bucket, the engine's fusion buffer is let go, every step costs one submission
per bucket, and each case the buckets must keep working (accumulation, sparse
gradients, compression, groups, missing gradients, zero_grad both ways,
clipping, two optimizers) or refuse clearly (a parameter whose shape changed
after step 1 fails every rank, naming it, without a hang)."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.api import runtime  # noqa: E402
from hvdlite.api.control import reconfigure  # noqa: E402
from tests.mpi.conftest import assert_identical_everywhere, submissions  # noqa: E402

STEPS, ROWS = 4, 3
TOLERANCE = 1e-12       # float64: only the order of the sums differs


@pytest.fixture(scope="module", autouse=True)
def _multi_rank_path() -> Iterator[None]:
    """HVDLITE_ONE_RANK_SHORTCUT=0: at world size 1 (a single GPU machine) the
    optimizer still makes its buckets and reduces them, as on several ranks."""
    reconfigure(one_rank_shortcut=False)
    yield
    reconfigure(one_rank_shortcut=True)


@pytest.fixture
def bucket_bytes() -> Iterator[Callable[[int], None]]:
    """Set HVDLITE_BUCKET_BYTES for the optimizers a test makes (negotiated, so every
    rank switches together), and put it back after."""
    previous = runtime.config().bucket_bytes
    yield lambda value: reconfigure(bucket_bytes=value)
    reconfigure(bucket_bytes=previous)


def _model(seed: int = 0) -> "torch.nn.Module":
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def _batch(rank: int, step: int) -> "torch.Tensor":
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(ROWS, 5, generator=generator, dtype=torch.float64)


def _loss(model: "torch.nn.Module", x: "torch.Tensor") -> "torch.Tensor":
    return model(x).pow(2).sum()


def _train(optimizer_of: Callable[[Any], Any], steps: int = STEPS,
           zero: Callable[[Any], None] = lambda o: o.zero_grad(),
           between: Callable[[Any, Any], None] = lambda m, o: None) -> "torch.nn.Module":
    model = _model()
    optimizer = optimizer_of(model)
    for step in range(steps):
        zero(optimizer)
        _loss(model, _batch(hvd.rank(), step)).backward()
        between(model, optimizer)
        optimizer.step()
    return model


def _distributed(model: "torch.nn.Module", **options: Any) -> Any:
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    named_parameters=model.named_parameters(), **options)


def _one_process(steps: int = STEPS) -> "torch.nn.Module":
    """One process on every rank's batch: the mean of the ranks' losses."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        (sum(_loss(model, _batch(r, step)) for r in range(hvd.size())) / hvd.size()).backward()
        optimizer.step()
    return model


def _params(model: "torch.nn.Module") -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def _assert_close(got: "torch.nn.Module", want: "torch.nn.Module") -> None:
    for a, b in zip(_params(got), _params(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("cap", [25 << 20, 1000])       # one bucket; one per few params
def test_buckets_match_one_process_and_the_per_gradient_path(cap: int, bucket_bytes) -> None:  # type: ignore[no-untyped-def]
    bucket_bytes(cap)
    bucketed = _train(_distributed)
    bucket_bytes(0)
    per_gradient = _train(_distributed)
    _assert_close(bucketed, _one_process())
    _assert_close(bucketed, per_gradient)
    assert_identical_everywhere(_params(bucketed))


def _bucket_params(optimizer: Any, bucket: Any) -> list:
    return [optimizer._params[i] for i in bucket.members]


def test_grads_are_views_of_the_buckets_from_the_first_step() -> None:
    model = _model()
    optimizer = _distributed(model)
    assert optimizer._reducer is None      # laid out when the first gradient arrives
    _loss(model, _batch(hvd.rank(), 0)).backward()
    optimizer.step()
    buckets = optimizer._reducer.buckets
    assert sum(len(b.members) for b in buckets) == len(list(model.parameters()))
    for bucket in buckets:
        start = bucket.flat.data_ptr()
        end = start + bucket.flat.numel() * bucket.flat.element_size()
        for param in _bucket_params(optimizer, bucket):
            assert param.grad._base is bucket.flat
            assert start <= param.grad.data_ptr() < end
    # Backward adds into the buckets (set_to_none=False keeps the views): averaged
    # results are read straight from .grad.
    optimizer.zero_grad(set_to_none=False)
    assert all(float(b.flat.abs().sum()) == 0.0 for b in buckets)
    _loss(model, _batch(hvd.rank(), 1)).backward()
    optimizer.synchronize()
    assert all(p.grad._base in [b.flat for b in buckets] for p in model.parameters())
    with optimizer.skip_synchronize():
        optimizer.step()


def test_the_layout_is_reverse_registration_order_with_a_small_first_bucket(
        bucket_bytes) -> None:  # type: ignore[no-untyped-def]
    """DDP's layout, known before any gradient: the last parameters (whose gradients
    backward produces first) in the first bucket, closed past 1 MiB, then buckets
    up to the cap. The same on every rank."""
    bucket_bytes(3 << 19)
    layers = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])  # 257 KiB each
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(layers.parameters(), lr=0.1),
                                         named_parameters=layers.named_parameters())
    layers(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    names = [[optimizer._reducer.names[i] for i in b.members] for b in optimizer._reducer.buckets]
    flat = [name for bucket in names for name in bucket]
    assert flat == [name for name, _ in reversed(list(layers.named_parameters()))]
    sizes = [sum(optimizer._params[i].numel() * 4 for i in b.members)
             for b in optimizer._reducer.buckets]
    assert sizes[0] <= 1 << 20 < sizes[0] + 256 * 256 * 4      # the next weight: past 1 MiB
    assert len(sizes) == 3 and all(size <= 3 << 19 for size in sizes)
    assert_identical_everywhere([np.array([len(b) for b in names])])


def test_the_fusion_buffer_is_let_go_when_the_buckets_are_made() -> None:
    """Buckets never pack into the engine's fusion buffer (a reducescatter, which
    always goes through the buffer, makes sure there is one here), so the buffer
    goes when they are made: its memory would sit beside them at every step's peak.
    Whatever packs afterwards gets a new buffer, and right sums."""
    fusion = runtime.engine().executor.fusion
    rows = torch.arange(2.0 * hvd.size()) + hvd.rank()
    hvd.reducescatter(rows, op=hvd.Sum)
    assert fusion.host_bytes > 0
    model = _model()
    optimizer = _distributed(model)
    for step in range(STEPS):
        optimizer.zero_grad()
        _loss(model, _batch(hvd.rank(), step)).backward()
        optimizer.step()
        assert optimizer._reducer is not None and fusion.host_bytes == 0
    _assert_close(model, _one_process())
    mine = hvd.reducescatter(rows, op=hvd.Sum)
    first = 2 * hvd.rank()
    expected = [hvd.size() * (first + i) + hvd.size() * (hvd.size() - 1) / 2 for i in range(2)]
    assert mine.tolist() == expected and fusion.host_bytes > 0


def test_every_step_is_one_submission_per_bucket(bucket_bytes) -> None:  # type: ignore[no-untyped-def]
    """The first step too: the layout's one exchange, then the buckets (no request per
    gradient, no second route)."""
    bucket_bytes(1000)
    model = _model()
    optimizer = _distributed(model)
    submitted: list[list[str]] = []
    for step in range(3):
        with submissions() as names:
            optimizer.zero_grad()
            _loss(model, _batch(hvd.rank(), step)).backward()
            optimizer.step()
        submitted.append(names)
    names = [b.name for b in optimizer._reducer.buckets]
    assert len(names) > 1
    first = [n for n in submitted[0] if not n.startswith("DistributedOptimizer.layout")]
    assert len(first) < len(submitted[0]) and first == names     # in layout order
    assert submitted[1] == submitted[2] == names


@pytest.mark.parametrize("zero", ["set_to_none", "zeros", "model", "alternating"])
def test_every_way_of_zeroing_gives_the_same_training(zero: str, bucket_bytes) -> None:  # type: ignore[no-untyped-def]
    bucket_bytes(1000)
    calls = iter(range(STEPS))      # alternating: to None, then zeros in place, ...
    zeroing = {"set_to_none": lambda o: o.zero_grad(),
               "zeros": lambda o: o.zero_grad(set_to_none=False),
               "alternating": lambda o: o.zero_grad(set_to_none=next(calls) % 2 == 0),
               "model": None}[zero]
    models: list = []

    def optimizer_of(model: Any) -> Any:
        models.append(model)
        return _distributed(model)
    if zeroing is None:        # model.zero_grad(): .grad None, behind the optimizer's back
        zeroing = lambda o: models[0].zero_grad()   # noqa: E731
    model = _train(optimizer_of, zero=zeroing)
    _assert_close(model, _one_process())
    if zero == "set_to_none":
        model_grads = [p.grad for p in model.parameters()]
        assert all(g is not None for g in model_grads)


@pytest.mark.parametrize("options", [{"backward_passes_per_step": 2},
                                     {"groups": [[2, 3]]},
                                     {"compression": "fp16"}],
                         ids=["accumulation", "groups", "fp16"])
def test_accumulation_sparse_compression_and_groups(options: dict, bucket_bytes) -> None:  # type: ignore[no-untyped-def]
    """Each with a sparse embedding (reduced by allgather, evicted from its bucket),
    against the same options with one bucket per gradient."""
    def run() -> list[np.ndarray]:
        torch.manual_seed(3)
        table = torch.nn.Embedding(10, 5, sparse=True).double()
        head = _model()
        params = list(table.parameters()) + list(head.parameters())
        settings = dict(options)
        if "groups" in settings:
            settings["groups"] = [[params[i] for i in g] for g in settings["groups"]]
        if "compression" in settings:
            settings["compression"] = hvd.Compression.fp16
        micro = settings.get("backward_passes_per_step", 1)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), **settings)
        for step in range(3):
            optimizer.zero_grad()
            for m in range(micro):
                ids = torch.tensor([(hvd.rank() + step) % 10, (3 * m) % 10])
                _loss(head, table(ids)).backward()
            optimizer.step()
        reducer = optimizer._reducer
        if reducer is not None and not reducer.alone:
            assert optimizer._sparse == {0}            # the table's: out of its bucket
            assert [b.evicted for b in reducer.buckets if 0 in b.members] == [{
                [b.members for b in reducer.buckets if 0 in b.members][0].index(0)}]
            if "groups" in settings:
                assert [b.members for b in reducer.buckets].count([2, 3]) == 1
        return [p.detach().numpy().copy() for p in params]
    bucket_bytes(1000)
    bucketed = run()
    bucket_bytes(0)
    per_gradient = run()
    for a, b in zip(bucketed, per_gradient):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 if "compression" in options
                                   else TOLERANCE)
    assert_identical_everywhere(bucketed)


def test_parameters_without_gradient_on_some_ranks(bucket_bytes) -> None:  # type: ignore[no-untyped-def]
    bucket_bytes(1000)
    model = _model()
    optimizer = _distributed(model)
    for step in range(3):
        optimizer.zero_grad()
        x = _batch(hvd.rank(), step)
        if hvd.rank() % 2:                 # odd ranks: the last layer gets no gradient
            model[:4](x).pow(2).sum().backward()
        else:
            _loss(model, x).backward()
        optimizer.step()
    assert_identical_everywhere(_params(model))


def test_clipping_between_synchronize_and_step(bucket_bytes) -> None:  # type: ignore[no-untyped-def]
    def clip(model: Any, optimizer: Any) -> None:
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)

    def clipped_step(optimizer: Any) -> None:
        with optimizer.skip_synchronize():
            type(optimizer).step(optimizer)

    def optimizer_of(model: Any) -> Any:
        optimizer = _distributed(model)
        optimizer.step = lambda: clipped_step(optimizer)    # the script's own step
        return optimizer
    bucket_bytes(1000)
    bucketed = _train(optimizer_of, between=clip)
    bucket_bytes(0)
    per_gradient = _train(optimizer_of, between=clip)
    _assert_close(bucketed, per_gradient)
    assert_identical_everywhere(_params(bucketed))


def test_two_optimizers_keep_their_buckets_apart() -> None:
    first, second = _model(1), _model(2)
    optimizers = [hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        named_parameters=[(f"{prefix}.{n}", p) for n, p in model.named_parameters()])
        for prefix, model in (("generator", first), ("critic", second))]
    for step in range(3):
        for optimizer in optimizers:
            optimizer.zero_grad()
        (_loss(first, _batch(hvd.rank(), step)) + _loss(second, _batch(hvd.rank(), step))).backward()
        for optimizer in optimizers:
            optimizer.step()
    names = [b.name for o in optimizers for b in o._reducer.buckets]
    assert len(set(names)) == len(names)
    assert_identical_everywhere(_params(first) + _params(second))


def test_a_parameter_whose_shape_changed_fails_every_rank_clearly() -> None:
    model = _model()
    optimizer = _distributed(model)
    _loss(model, _batch(hvd.rank(), 0)).backward()
    optimizer.step()
    if hvd.rank() == 0:        # one rank widens the last layer after step 1
        model[4].weight.data = torch.zeros(4, 16, dtype=torch.float64)
        model[4].bias.data = torch.zeros(4, dtype=torch.float64)
    optimizer.zero_grad()
    with pytest.raises(hvd.HvdliteError, match=r"rank 0: .*'4\.(weight|bias)'.* bucket"):
        _loss(model, _batch(hvd.rank(), 1)).backward()
        optimizer.step()


@pytest.mark.parametrize("shortcut", [True, False])
def test_a_process_set_reduces_among_its_members_and_others_keep_their_own(
        shortcut: bool) -> None:
    """Horovod's semantics: ranks outside the optimizer's set train on their own
    gradients; the members' buckets reduce over the set only. A set of one rank
    (the even ranks at -n 2) makes no buckets unless the one-rank shortcut is off."""
    if hvd.size() == 1:
        pytest.skip("at world size 1 the even ranks are the global set, which cannot be "
                    "added again (Horovod refuses a duplicate set too)")
    evens = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 0])
    reconfigure(one_rank_shortcut=shortcut)
    try:
        model = _model()
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(), process_set=evens)
        for step in range(3):
            optimizer.zero_grad()
            _loss(model, _batch(hvd.rank(), step)).backward()
            optimizer.step()
        reference = _model()
        plain = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        ranks = evens.ranks if evens.included() else [hvd.rank()]
        for step in range(3):
            plain.zero_grad()
            (sum(_loss(reference, _batch(r, step)) for r in ranks) / len(ranks)).backward()
            plain.step()
        _assert_close(model, reference)
        made = evens.included() and (evens.size() > 1 or not shortcut)
        reducer = optimizer._reducer
        assert (reducer is not None and reducer.buckets[0].flat is not None) == made
    finally:
        reconfigure(one_rank_shortcut=False)
        hvd.remove_process_set(evens)
