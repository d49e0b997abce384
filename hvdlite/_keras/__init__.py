"""The Keras 3 code that ``hvdlite.keras`` and ``hvdlite.tensorflow`` share (as
Horovod's ``horovod/_keras``): the DistributedOptimizer wrapper and ``local_layers``.
It runs on any Keras backend, given that backend's binding support (see
``optimizer``), and imports neither ``hvdlite.keras`` nor ``hvdlite.tensorflow``, so
imports run one way: hvdlite.keras -> hvdlite.tensorflow -> hvdlite._keras."""
