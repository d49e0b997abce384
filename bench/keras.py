"""Keras 3 training throughput: ``model.fit`` with hvdlite.keras's
DistributedOptimizer against ``model.fit`` under
tf.distribute.MultiWorkerMirroredStrategy, and hvdlite's DistributedGradientTape
in a custom ``tf.function`` loop, in one run.

    python -m bench keras        # runs np=1 and np=2 itself, prints the table

Each method and model runs in its own mpiexec launch, rounds interleave the
methods, and the table gives medians with their spread (bench/launches.py).

Same model, optimizer (SGD with momentum) and synthetic data for every method;
one intra-op and one inter-op thread per rank; ``jit_compile=False`` (what
Keras' "auto" resolves to on a CPU). Each rank trains on B rows per step: hvdlite
reads B rows per rank, MultiWorkerMirroredStrategy a global batch of B x np that
it splits into B rows per worker. Samples/s counts the global batch over the
timed steps, after the warm-up steps, on the slowest rank. The strategy's
workers find each other through TF_CONFIG on localhost ports that rank 0 picks
and broadcasts with mpi4py.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from typing import Any, Optional, Sequence

from bench import launches

MODELS = ("mlp", "cnn")
METHODS = ("hvdlite", "mwms", "tape")
LABELS = {"hvdlite": "hvdlite fit", "mwms": "MWMS fit", "tape": "hvdlite tape"}
BATCH = {"mlp": 64, "cnn": 32}   # per rank


def _tensorflow() -> Any:
    """TensorFlow with one intra-op and one inter-op thread: set before anything
    creates TensorFlow's context, which fixes them for the process."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def _build(name: str) -> tuple[Any, tuple[int, ...]]:
    """The model (10 classes, identical initial weights on every rank) and its
    per-sample input shape; the same networks as ``bench training``."""
    import keras
    keras.utils.set_random_seed(0)
    layers = keras.layers
    if name == "mlp":
        return keras.Sequential([layers.Input((784,)), layers.Dense(1024, activation="relu"),
                                 layers.Dense(1024, activation="relu"),
                                 layers.Dense(10)]), (784,)
    return keras.Sequential([
        layers.Input((32, 32, 3)), layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(2), layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(2), layers.Flatten(), layers.Dense(256, activation="relu"),
        layers.Dense(10)]), (32, 32, 3)


def _arrays(shape: tuple[int, ...], rows: int, seed: int) -> tuple[Any, Any]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows,) + shape, dtype=np.float32),
            rng.integers(0, 10, size=(rows,)))


def _compile(model: Any, optimizer: Any) -> None:
    import keras
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _sgd() -> Any:
    import keras
    return keras.optimizers.SGD(0.01, momentum=0.9)


def _timer(warmup: int, steps: int) -> Any:
    import keras

    class Timer(keras.callbacks.Callback):
        """Seconds from the end of the last warm-up batch to the end of the last one."""

        def __init__(self) -> None:
            super().__init__()
            self.start = self.seconds = None

        def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
            if batch == warmup - 1:
                self.start = time.perf_counter()
            elif batch == warmup + steps - 1:
                self.seconds = time.perf_counter() - self.start
    return Timer()


def _fit(model: Any, dataset: Any, warmup: int, steps: int, callbacks: list) -> float:
    timer = _timer(warmup, steps)
    model.fit(dataset, steps_per_epoch=warmup + steps, epochs=1, verbose=0, shuffle=False,
              callbacks=callbacks + [timer])
    if timer.seconds is None:
        raise RuntimeError(f"fit ran fewer than {warmup + steps} batches")
    return timer.seconds


def _run_hvdlite(name: str, comm: Any, warmup: int, steps: int, batch: int) -> float:
    tf = _tensorflow()
    import hvdlite.keras as hvd
    hvd.init()
    try:
        model, shape = _build(name)
        _compile(model, hvd.DistributedOptimizer(_sgd()))
        data = tf.data.Dataset.from_tensors(_arrays(shape, batch, comm.Get_rank())).repeat()
        return _fit(model, data, warmup, steps, [hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    finally:
        hvd.shutdown()


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free localhost ports (all held open until all are chosen)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _run_mwms(name: str, comm: Any, warmup: int, steps: int, batch: int) -> float:
    rank, size = comm.Get_rank(), comm.Get_size()
    ports = comm.bcast(_free_ports(size) if rank == 0 else None, root=0)
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{port}" for port in ports]},
        "task": {"type": "worker", "index": rank}})
    tf = _tensorflow()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    if strategy.num_replicas_in_sync != size:
        raise RuntimeError(f"MultiWorkerMirroredStrategy has {strategy.num_replicas_in_sync} "
                           f"replicas for {size} ranks")
    with strategy.scope():
        model, shape = _build(name)
        _compile(model, _sgd())
    # The global batch B x np: the strategy splits it into B rows per worker.
    # (Keras 3.15's fit cannot take distribute_datasets_from_function's
    # per-replica values.) Sharding off: the data is synthetic, so no worker
    # needs to read and drop the others' rows.
    data = tf.data.Dataset.from_tensors(_arrays(shape, batch * size, rank)).repeat()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    data = data.with_options(options)
    rows = strategy.experimental_local_results(
        next(iter(strategy.experimental_distribute_dataset(data)))[0])[0].shape[0]
    if rows != batch:
        raise RuntimeError(f"MultiWorkerMirroredStrategy gives {rows} rows per worker, "
                           f"not {batch}")
    _prebuild(model, strategy, data)
    _patch_keras_scalar_logs()
    return _fit(model, data, warmup, steps, [])


def _prebuild(model: Any, strategy: Any, data: Any) -> None:
    """Build the compiled model's state from one local batch, and skip fit's own
    build. Keras 3.15's fit, under a strategy with more than one replica, first
    calls ``strategy.reduce("MEAN", (x, y))`` on the whole distributed batch
    (trainer._maybe_symbolic_build), which MultiWorkerMirroredStrategy refuses
    ("Attempt to convert a value (PerReplica...) to a Tensor")."""
    with strategy.scope():
        model._symbolic_build(data_batch=next(iter(data)))
    model._maybe_symbolic_build = lambda iterator=None, data_batch=None: None


def _patch_keras_scalar_logs() -> None:
    """Keras 3.15's train step, on more than one worker, averages every logged
    value with ``strategy.reduce("MEAN", v, axis=0)``, which fails on the scalar
    loss ("Invalid reduction dimension 0 for input with 0 dimensions";
    tensorflow/tensorflow#72388, Keras 3 and MultiWorkerMirroredStrategy).
    Scalars are averaged over replicas instead (axis=None): only the logs change,
    not the training step being timed."""
    from keras.src.backend.tensorflow import trainer
    plain = trainer.reduce_per_replica
    if getattr(plain, "hvdlite_patched", False):
        return

    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        if reduction not in ("auto", "mean") or \
                not trainer._collective_all_reduce_multi_worker(strategy):
            return plain(values, strategy, reduction)

        def one(value: Any) -> Any:
            if strategy.experimental_local_results(value)[0].shape.rank == 0:
                return strategy.reduce("MEAN", value, axis=None)
            return plain(value, strategy, reduction)
        return trainer.tree.map_structure(one, values)
    reduce_per_replica.hvdlite_patched = True   # type: ignore[attr-defined]
    trainer.reduce_per_replica = reduce_per_replica


def _run_tape(name: str, comm: Any, warmup: int, steps: int, batch: int) -> float:
    tf = _tensorflow()
    import keras
    import hvdlite.tensorflow as hvd
    hvd.init()
    try:
        model, shape = _build(name)
        optimizer = _sgd()
        optimizer.build(model.trainable_variables)
        hvd.broadcast_variables(model.variables + list(optimizer.variables), root_rank=0)
        x, y = (tf.constant(a) for a in _arrays(shape, batch, comm.Get_rank()))
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def step() -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        for _ in range(warmup):
            step()
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        float(loss)   # the last step's result, so the clock stops after it
        return time.perf_counter() - start
    finally:
        hvd.shutdown()


def worker(argv: Sequence[str]) -> None:
    """One method on one model, under mpiexec; rank 0 prints ``RESULT {json}``."""
    from mpi4py import MPI
    parser = launches.worker_parser(METHODS, MODELS)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=None, help="rows per rank per step")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        sys.exit("--warmup and --steps must be at least 1")
    comm = MPI.COMM_WORLD.Dup()
    batch = args.batch or BATCH[args.model]
    runners = {"hvdlite": _run_hvdlite, "mwms": _run_mwms, "tape": _run_tape}
    try:
        seconds = runners[args.method](args.model, comm, args.warmup, args.steps, batch)
    except BaseException:
        if args.method != "mwms":
            raise
        # Exit now, with the error: the strategy's gRPC threads can keep a failed
        # worker from exiting, and its peers would wait on it for good.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    slowest = comm.allreduce(seconds, op=MPI.MAX)
    launches.report_rate(comm, batch * comm.Get_size() * args.steps / slowest)
    comm.Barrier()
    if args.method == "mwms":
        # The strategy's gRPC server has no shutdown and can keep the process
        # alive at exit; every rank is done with it past the barrier above.
        sys.stdout.flush()
        MPI.Finalize()
        os._exit(0)


def _mwms_failure(model: str, np_: int) -> Optional[str]:
    """Why MultiWorkerMirroredStrategy cannot train here at ``np_`` (its launch's
    error output), or None when a short run works."""
    probe = launches.Method("mwms", ("keras-worker", "--method", "mwms", "--model", model,
                                     "--warmup", "1", "--steps", "1"))
    try:
        launches.launch(probe, np_)
    except Exception as error:   # a failed launch, a timeout: say it, time the others
        return f"{type(error).__name__}: {error}"
    return None


def _print_table(rows: list, rounds: int, failures: dict) -> None:
    print(f"\nKeras 3 training throughput, samples/s (global batch; one intra-op and one "
          f"inter-op thread per rank; SGD with momentum). Each method in its own mpiexec "
          f"launch, {rounds} interleaved rounds: median, and the min-max spread as % of "
          "the median; ratios are of medians, with the range of the per-round ratios.")
    print(f"{'model':>5} {'np':>3} | " + " ".join(f"{LABELS[m]:>15}" for m in METHODS) +
          f" | {'fit vs MWMS':>17} {'tape vs MWMS':>17}")
    for model, np_, samples in rows:
        cells = " ".join(f"{samples[m].median:9.0f} {samples[m].spread():>5}" if m in samples
                         else f"{'failed':>15}" for m in METHODS)
        versus = [launches.ratio(samples[m], samples["mwms"]) if "mwms" in samples else "-"
                  for m in ("hvdlite", "tape")]
        print(f"{model:>5} {np_:>3} | {cells} | {versus[0]:>17} {versus[1]:>17}")
    by_key = {(model, np_): samples for model, np_, samples in rows}
    for model in dict.fromkeys(model for model, _, _ in rows):
        if (model, 1) in by_key and (model, 2) in by_key:
            one, two = by_key[(model, 1)], by_key[(model, 2)]
            scaling = ", ".join(f"{LABELS[m]} {two[m].median / one[m].median:.2f}x"
                                for m in METHODS if m in one and m in two)
            print(f"{model}: np=2 / np=1 samples/s: {scaling}")
    for (model, np_), reason in failures.items():
        print(f"\nMultiWorkerMirroredStrategy could not run ({model}, np={np_}):\n{reason}")


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench keras",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["mlp"])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved launches per method")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per launch")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per launch")
    parser.add_argument("--batch", type=int, default=None, help="rows per rank per step")
    args = parser.parse_args(argv)
    rows, failures = [], {}
    for np_ in args.np:
        for model in args.models:
            options = ("--model", model, "--warmup", str(args.warmup), "--steps",
                       str(args.steps)) + (("--batch", str(args.batch)) if args.batch else ())
            failure = _mwms_failure(model, np_)
            if failure is not None:
                failures[(model, np_)] = failure
                print(f"keras {model} np={np_}: MultiWorkerMirroredStrategy failed, timing "
                      "the others (reason at the end)", file=sys.stderr, flush=True)
            methods = [launches.Method(m, ("keras-worker", "--method", m) + options)
                       for m in METHODS if m != "mwms" or failure is None]
            rows.append((model, np_, launches.interleaved(
                methods, np_, args.rounds, "samples_per_s", progress=f"keras {model}")))
    _print_table(rows, args.rounds, failures)
    if failures:
        sys.exit(1)
