"""The API layer: lifecycle, process sets, tensor adapters and the binding
factory that turns the core's array-level collectives into each framework's
public op set. Imports only the core's MPI-free modules at import time."""
