"""``horovod.tensorflow.compression`` for scripts that import it by that name
(``from horovod.tensorflow.compression import Compression``): hvdlite's wire
compression, the same classes as ``hvdlite.tensorflow.Compression`` and every
other binding's."""
from hvdlite.api.compression import (BF16Compressor, Compression, Compressor, FP16Compressor,
                                     NoneCompressor)

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]
