"""Which tests judge each module's mutants (tests/mutation/mutate.py runs them).

Stages run cheapest first and stop at the first failure; a stage that fails or runs
past the module's limit kills the mutant. An in-process first stage (unit tests, a fake
communicator, the engine at one rank, a stand-in for CuPy) kills most mutants in
seconds, so the real MPI runs judge only the few that survive it.
"""
from __future__ import annotations

# A stage: ("unit", pytest args) runs pytest in one process; ("mpi<N>", args) runs
# tests/mpi/run.py under mpiexec -n N.
Stage = tuple[str, str]
_UNIT_PLANNING = ("unit", "tests/unit/test_planning.py")
# The host backends at every size in one process (threads over a fake communicator):
# a second, and it kills most backend mutants, hangs included, before any mpiexec.
_UNIT_BACKENDS = ("unit", "tests/unit/test_backends.py tests/unit/test_planning.py")
# The GPU backends under a fake CuPy and NCCL (tests/unit/fake_cupy.py, fake_nccl.py), every
# rank a thread over the fake communicator: seconds, no GPU.
_UNIT_GPU = ("unit", "tests/unit/test_gpu_backends.py tests/unit/test_gpu_staged.py")
_MPI_REDUCE = ("mpi2", "tests/mpi/test_scaling.py tests/mpi/test_allreduce.py "
                       "tests/mpi/test_collectives.py")
_MPI_TRAFFIC = ("mpi2", "tests/mpi/test_traffic.py")
# Every test the `backend` fixture runs on the ring, and the ring's byte counts.
_RING_TESTS = ("tests/mpi/test_allreduce.py tests/mpi/test_collectives.py "
               "tests/mpi/test_scaling.py tests/mpi/test_traffic.py -k ring")

# The executor and its packing (packing.py) at 1 to 4 ranks over the fake communicator
# first (seconds, and most mutants die there); the real runs after it judge the rest.
_EXECUTOR_STAGES: list[Stage] = [
    ("unit", "tests/unit/test_executor.py tests/unit/test_executor_runs.py "
             "tests/unit/test_stream_ordered.py tests/unit/test_scaling.py "
             "-knot(tensorflow)"), _MPI_REDUCE,
    ("mpi2", "tests/mpi/test_inplace_strides.py tests/mpi/test_adasum.py"),
    ("mpi3", "tests/mpi/test_scaling.py")]
# The engine and how it stops (stopping.py) at one rank in the test process first
# (tests/unit/engine_rig.py: a real Engine over COMM_SELF, stepped one iteration at a
# time; found necessary by make mutate: with only MPI stages each mutant cost minutes of
# mpiexec runs). Then rounds, the response cache, errors, process sets and
# reconfiguration at -n 2; the overlapping sets at -n 3; then whole jobs: crashes,
# stalls, shutdowns, lost peers, the timeline and the report.
_ENGINE_STAGES: list[Stage] = [
    ("unit", "tests/unit/test_engine.py tests/unit/test_engine_stop.py"),
    ("mpi2", "tests/mpi/test_allreduce.py tests/mpi/test_errors.py "
             "tests/mpi/test_process_set_registry.py"),
    ("mpi2", "tests/mpi/test_collectives.py tests/mpi/test_bad_inputs.py "
             "tests/mpi/test_one_rank_errors.py tests/mpi/test_unnamed_ops.py "
             "tests/mpi/test_traffic.py tests/mpi/test_torch_optimizer.py"),
    ("mpi3", "tests/mpi/test_process_set_registry.py tests/mpi/test_unnamed_ops.py"),
    ("unit", "tests/integration/test_jobs.py tests/integration/test_liveness.py "
             "tests/integration/test_report.py -knot(hvdliterun)and(not(pytorch))"
             "and(not(numpy_demo))and(not(every_time))")]

# module -> (seconds allowed per mutant, stages)
TESTS: dict[str, tuple[int, list[Stage]]] = {
    "hvdlite/engine/fusion.py": (300, [
        ("unit", "tests/unit/test_fusion.py tests/unit/test_planning.py"), _MPI_REDUCE]),
    "hvdlite/negotiation/coordinator.py": (300, [
        ("unit", "tests/unit/test_negotiation.py tests/unit/test_planning.py"),
        ("mpi2", "tests/mpi/test_errors.py tests/mpi/test_bad_inputs.py "
                 "tests/mpi/test_collectives.py")]),
    "hvdlite/engine/executor.py": (400, _EXECUTOR_STAGES),
    "hvdlite/engine/packing.py": (400, _EXECUTOR_STAGES),   # the executor's own packing
    "hvdlite/engine/scaling.py": (300, [
        ("unit", "tests/unit/test_scaling.py tests/unit/test_stream_ordered.py"),
        ("mpi3", "tests/mpi/test_scaling.py")]),
    # The device registry: its unit tests stand in a device, a stream backend and a plugin.
    "hvdlite/engine/devices.py": (60, [
        ("unit", "tests/unit/test_devices.py tests/unit/test_stream_ordered.py "
                 "tests/unit/test_backend_registry.py"),
        ("mpi2", "tests/mpi/test_allreduce.py")]),
    "hvdlite/engine/chain.py": (60, [
        ("unit", "tests/unit/test_chain.py tests/unit/test_stream_ordered.py "
                 "tests/unit/test_backend_registry.py"),
        ("mpi2", "tests/mpi/test_allreduce.py tests/mpi/test_traffic.py "
                 "tests/mpi/test_registered_backend.py")]),
    # The backend registry: names, devices, order; a backend from outside the package.
    "hvdlite/backends/registry.py": (60, [
        ("unit", "tests/unit/test_backend_registry.py tests/unit/test_chain.py"),
        ("mpi2", "tests/mpi/test_registered_backend.py")]),
    # Plain threading code, fully exercised by its unit tests.
    "hvdlite/engine/handles.py": (60, [("unit", "tests/unit/test_handles.py")]),
    # rank 0's stall checks over the real coordinator, with a fake clock; the note for a
    # stall held behind a stuck round, through the engine.
    "hvdlite/failure/stall.py": (60, [
        ("unit", "tests/unit/test_stall.py tests/unit/test_engine.py")]),
    # init(process_sets=...)'s agreement, pure and at engine set-up, then while running.
    "hvdlite/negotiation/set_agreement.py": (60, [
        ("unit", "tests/unit/test_set_agreement.py"),
        ("mpi2", "tests/mpi/test_init_process_sets.py")]),
    # The thread level asked for; whole jobs that leave MPI to hvdlite or initialise it.
    "hvdlite/transport/mpi_init.py": (120, [
        ("unit", "tests/unit/test_mpi_init.py tests/integration/test_mpi_init.py")]),
    # The trace writer's thread, its file and a process that never closes it.
    "hvdlite/recording/timeline.py": (60, [("unit", "tests/unit/test_timeline.py")]),
    "hvdlite/transport/mpi_library.py": (60, [
        ("unit", "tests/unit/test_mpi_library.py tests/unit/test_runner.py")]),
    # Descriptors, requests and responses, then the modules that read them, all in-process.
    "hvdlite/negotiation/requests.py": (60, [
        ("unit", "tests/unit/test_requests.py tests/unit/test_negotiation.py "
                 "tests/unit/test_cache.py tests/unit/test_fusion.py "
                 "tests/unit/test_planning.py")]),
    # Process sets over a fake world communicator, then real splits under MPI.
    "hvdlite/negotiation/process_sets.py": (60, [
        ("unit", "tests/unit/test_process_sets.py"),
        ("mpi2", "tests/mpi/test_process_set_registry.py")]),
    # Layouts of uneven nodes over threads (a communicator that splits as MPI would), then
    # the real splits.
    "hvdlite/transport/topology.py": (60, [
        ("unit", "tests/unit/test_topology.py tests/unit/test_planning.py "
                 "tests/unit/test_runner.py"),
        ("mpi2", "tests/mpi/test_topology.py")]),
    "hvdlite/recording/recorder.py": (60, [
        ("unit", "tests/unit/test_recorder.py tests/unit/test_report.py")]),
    # The wait schedule over a fake clock and fake MPI requests; batches and the doorbell;
    # the idle ticks (test_engine.py) and all_done (test_process_sets.py).
    "hvdlite/failure/waiting.py": (60, [
        ("unit", "tests/unit/test_waiting.py tests/unit/test_batches.py "
                 "tests/unit/test_handles.py tests/unit/test_engine.py "
                 "tests/unit/test_process_sets.py")]),
    # The guard runs as a real child process (a socketpair stands in for hydra's PMI fd).
    "hvdlite/failure/exit_guard.py": (60, [
        ("unit", "tests/unit/test_exit_guard.py"),
        ("unit", "tests/unit/test_liveness.py -k guard")]),
    # Aborts, exits and hooks in-process, with MPI_Abort and os._exit faked; then the
    # recorded sys.exit status at a real interpreter exit.
    "hvdlite/failure/abort_on_error.py": (60, [
        ("unit", "tests/unit/test_failure.py"),
        ("unit", "tests/unit/test_liveness.py -k sys_exit")]),
    # The Monitor and the check in-process, then full negotiation rounds at -n 2.
    "hvdlite/failure/liveness.py": (60, [
        ("unit", "tests/unit/test_liveness_check.py tests/unit/test_liveness.py "
                 "-k not(guard)and(not(sys_exit))"),
        ("mpi2", "tests/mpi/test_process_set_registry.py")]),
    # MPI's transport: the channel, rounds and awaited gather and bcast on a one-rank world,
    # then the conformance checks every transport passes, at -n 2.
    "hvdlite/transport/mpi_transport.py": (60, [
        ("unit", "tests/unit/test_liveness_check.py tests/unit/test_process_sets.py"),
        ("mpi2", "tests/mpi/test_transport_conformance.py")]),
    # Stand-in peers are child processes of the test, killed to play a rank that dies.
    "hvdlite/failure/sentinel.py": (60, [
        ("unit", "tests/unit/test_sentinel.py")]),
    "hvdlite/engine/engine.py": (600, _ENGINE_STAGES),
    "hvdlite/engine/stopping.py": (600, _ENGINE_STAGES),   # how the engine stops, inherited
    "hvdlite/negotiation/cache.py": (300, [
        ("unit", "tests/unit/test_cache.py"), _UNIT_PLANNING, ("mpi2", "tests/mpi/test_allreduce.py tests/mpi/test_errors.py")]),
    "hvdlite/api/compression.py": (300, [
        ("unit", "tests/unit/test_compression.py"),
        ("mpi2", "tests/mpi/test_scaling.py"),
        ("mpi2", "tests/mpi/test_torch_training.py tests/mpi/test_torch_api.py")]),
    "hvdlite/reducer/buckets.py": (400, [
        ("unit", "tests/unit/test_reducer.py"),
        ("mpi2", "tests/mpi/test_torch_buckets.py tests/mpi/test_torch_training.py "
                 "tests/mpi/test_torch_optimizer.py"),
        ("mpi2", "tests/mpi/test_tf_tape.py tests/mpi/test_keras_fit.py")]),
    "hvdlite/reducer/layout.py": (200, [
        ("unit", "tests/unit/test_reducer.py"),
        ("mpi2", "tests/mpi/test_torch_buckets.py")]),
    "hvdlite/reducer/settings.py": (200, [
        ("unit", "tests/unit/test_reducer.py"),
        ("mpi2", "tests/mpi/test_torch_training.py tests/mpi/test_tf_tape.py")]),
    "hvdlite/reducer/lists.py": (200, [
        ("mpi2", "tests/mpi/test_tf_tape.py tests/mpi/test_keras_optimizer.py "
                 "tests/mpi/test_keras_buckets.py")]),
    "hvdlite/torch/optimizer.py": (400, [
        ("mpi2", "tests/mpi/test_torch_training.py tests/mpi/test_torch_api.py "
                 "tests/mpi/test_torch_parity.py tests/mpi/test_torch_optimizer.py"),
        ("mpi2", "tests/mpi/test_adasum.py -k optimizer")]),   # op=Adasum's own class
    "hvdlite/torch/reduction.py": (400, [
        ("mpi2", "tests/mpi/test_torch_frozen.py tests/mpi/test_torch_buckets.py "
                 "tests/mpi/test_torch_optimizer.py tests/mpi/test_torch_grad_scaler.py")]),
    "hvdlite/torch/grad_scaling.py": (100, [
        ("mpi2", "tests/mpi/test_torch_grad_scaler.py")]),
    # The other bindings' optimizers: torch's Adasum optimizer, the TensorFlow tape and
    # gradient helpers, and Keras 3's DistributedOptimizer (TensorFlow backend), each
    # through the MPI tests that train with them.
    "hvdlite/torch/adasum_optimizer.py": (300, [("mpi2", "tests/mpi/test_adasum.py")]),
    "hvdlite/tensorflow/tape.py": (300, [
        ("mpi2", "tests/mpi/test_tf_tape.py tests/mpi/test_tf_scatter_grads.py "
                 "tests/mpi/test_tf_ops.py")]),
    "hvdlite/tensorflow/gradients.py": (300, [
        ("mpi2", "tests/mpi/test_tf_tape.py tests/mpi/test_tf_scatter_grads.py "
                 "tests/mpi/test_keras_fit.py")]),
    "hvdlite/_keras/optimizer.py": (400, [
        ("mpi2", "tests/mpi/test_keras_optimizer.py"),     # its own tests first: seconds
        ("mpi2", "tests/mpi/test_keras_fit.py tests/mpi/test_keras_momentum.py"),
        ("mpi2", "tests/mpi/test_keras_elastic.py")]),
    # The backends: their unit tests first, then the real MPI runs of the collectives
    # and of the byte counters (hvd.traffic()). Each MPI stage takes seconds here; the
    # limits are for the mutants that deadlock a rank (a wrong tag, peer or segment).
    "hvdlite/backends/base.py": (60, [
        ("unit", "tests/unit/test_backend_base.py tests/unit/test_fusion.py"),
        _UNIT_BACKENDS, _MPI_REDUCE, _MPI_TRAFFIC]),
    "hvdlite/backends/mpi.py": (60, [_UNIT_BACKENDS, _MPI_REDUCE, _MPI_TRAFFIC]),
    # The ring also at -n 3 (the backend fixture's ring runs and its byte counts): at
    # 2 ranks every schedule has one step, so only an odd size shows an off-by-one.
    "hvdlite/backends/ring.py": (60, [_UNIT_BACKENDS, _MPI_REDUCE, _MPI_TRAFFIC,
                                      ("mpi3", _RING_TESTS)]),
    # The server at -n 3 as well: a set whose server is not global rank 0 needs 3 ranks.
    "hvdlite/backends/ps.py": (60, [_UNIT_BACKENDS, _MPI_REDUCE, _MPI_TRAFFIC,
                                    ("mpi3", "tests/mpi/test_traffic.py")]),
    # The formula, then the backend at 1 to 8 ranks over the fake communicator (at 2
    # ranks every loop of the halving, the group sums and the allgather runs once).
    "hvdlite/backends/adasum.py": (300, [
        ("unit", "tests/unit/test_adasum.py tests/unit/test_adasum_ranks.py"),
        ("mpi2", "tests/mpi/test_adasum.py")]),
    # The GPU path: only its unit tests judge it. The real GPU tests (tests/mpi/test_gpu_torch.py,
    # test_gpu_tf.py) need a GPU and CuPy, and are not a stage: without them they skip, and a
    # skip kills nothing. On a machine with a GPU, run them by hand on the survivors.
    "hvdlite/backends/gpu.py": (60, [_UNIT_GPU]),
    "hvdlite/backends/cuda.py": (60, [_UNIT_GPU]),
    "hvdlite/backends/nccl.py": (60, [_UNIT_GPU]),
    "hvdlite/backends/staged.py": (60, [_UNIT_GPU]),
}
