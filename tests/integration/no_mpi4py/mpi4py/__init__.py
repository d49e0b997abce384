"""Put first on PYTHONPATH, this makes a machine without mpi4py out of one with it
(tests/integration/test_torchrun.py): ``import mpi4py`` fails as it would there."""
raise ModuleNotFoundError("No module named 'mpi4py' (hidden by tests/integration/no_mpi4py)",
                          name="mpi4py")
