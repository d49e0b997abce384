# make demo (torch) / make demo-keras (Keras 3 on TensorFlow): multi-rank training of a CNN on
# the digits data set on this machine.  make test: every test.
# Both create .venv (Python 3.11 + pip is all they need) and install pinned versions.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
NP ?= 2
# Hard limit per MPI test run: a hang fails the run instead of stalling CI.
RUN_LIMIT := timeout -k 10 900
MPI_PYTEST := $(PY) tests/mpi/run.py

.PHONY: install demo demo-keras test test-unit test-slurm test-mpi bench mutate clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[mpich,torch,tensorflow,examples,test,report]'
	touch $@

demo: install
	$(MPIEXEC) -n $(NP) $(PY) examples/pytorch_digits.py

demo-keras: install
	$(MPIEXEC) -n $(NP) $(PY) examples/keras_digits.py

test-unit: install
	$(PY) -m pytest -q tests/unit tests/integration

# A real SLURM cluster on this host (installs Debian's slurm-wlm + munge if missing;
# skips with the reason where that is impossible).
test-slurm: install
	$(PY) -m pytest -q tests/slurm

# Overlapping process sets ([0,1] and [1,2]) need three ranks: those files also run at -n 3.
OVERLAP_TESTS := tests/mpi/test_unnamed_ops.py tests/mpi/test_process_set_registry.py
# Properties only a size that is not a power of two shows (Average's exact division):
# also run at -n 3 (the size-specific tests skip at 2 and 4 and say why).
NP3_TESTS := tests/mpi/test_scaling.py

# Keras on the torch backend needs KERAS_BACKEND=torch before keras is imported: its own runs
# (in the runs above the file skips itself).
KERAS_TORCH_TESTS := tests/mpi/test_keras_torch.py

test-mpi: install
	$(RUN_LIMIT) $(MPIEXEC) -n 2 $(MPI_PYTEST) tests/mpi
	$(RUN_LIMIT) $(MPIEXEC) -n 3 $(MPI_PYTEST) $(OVERLAP_TESTS) $(NP3_TESTS)
	$(RUN_LIMIT) $(MPIEXEC) -n 4 $(MPI_PYTEST) tests/mpi
	KERAS_BACKEND=torch $(RUN_LIMIT) $(MPIEXEC) -n 2 $(MPI_PYTEST) $(KERAS_TORCH_TESTS)
	KERAS_BACKEND=torch $(RUN_LIMIT) $(MPIEXEC) -n 4 $(MPI_PYTEST) $(KERAS_TORCH_TESTS)

test: test-unit test-slurm test-mpi

# Mutation testing (cosmic-ray; not part of make test): every module mapped in
# tests/mutation/mutate.py, or one: make mutate MODULE=hvdlite/core/fusion.py
MODULE ?=
$(VENV)/.installed-mutate: $(VENV)/.installed
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[mutate]'
	touch $@

mutate: $(VENV)/.installed-mutate
	nice -n 10 $(PY) tests/mutation/mutate.py $(MODULE)

bench: install
	$(MPIEXEC) -n $(NP) $(PY) -m hvdlite.bench allreduce
	$(PY) -m hvdlite.bench training

clean:
	rm -rf $(VENV) .pytest_cache .mutation build *.egg-info
