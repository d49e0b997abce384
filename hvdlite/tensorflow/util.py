"""``horovod.tensorflow.util`` for scripts and tests that name it
(``hvd.util._executing_eagerly()``): the one helper of it that user code calls."""
from hvdlite.tensorflow.basics import _executing_eagerly  # noqa: F401
