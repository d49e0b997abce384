"""init() agrees on the backend registry over the transport: a backend registered on
some ranks only fails init() on every rank (BackendRegistryMismatchError naming those
ranks and the backend), nothing waits on another rank, and once every rank's registry
is the same, init() works again."""
from __future__ import annotations

import numpy as np
import pytest

import hvdlite as hvd
from hvdlite.backends import register_backend, unregister_backend
from hvdlite.errors import BackendRegistryMismatchError
from tests.mpi.toy_backend import ToyBackend

pytestmark = pytest.mark.timeout(60)


def test_a_backend_registered_on_odd_ranks_only_fails_init_on_every_rank() -> None:
    rank, size = hvd.rank(), hvd.size()
    hvd.shutdown()
    odd = list(range(1, size, 2))
    if rank in odd:
        register_backend("toy", ToyBackend)
    try:
        with pytest.raises(BackendRegistryMismatchError) as info:
            hvd.init()
    finally:
        if rank in odd:
            unregister_backend("toy")
    text = str(info.value)
    assert text.startswith(f"rank {rank}: ") and "also has ['toy']" in text, text
    assert info.value.ranks == odd and info.value.backends == ["toy"]
    assert "before hvdlite.init()" in text
    hvd.init()                                     # the same registry everywhere: it runs
    assert hvd.allreduce(np.ones(1), op=hvd.Sum, name="agreed.after").tolist() == [size]

