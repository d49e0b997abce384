"""``hvd.elastic`` for ``import hvdlite.torch as hvd``: Horovod's torch elastic API
over restart-based recovery (see ``hvdlite.elastic.driver``)."""
from hvdlite.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState,
                             State, run, run_fn)
from hvdlite.torch.elastic.sampler import ElasticSampler
from hvdlite.torch.elastic.state import TorchState

__all__ = ["TorchState", "ElasticSampler", "run", "run_fn", "State", "ObjectState",
           "HorovodInternalError", "HostsUpdatedInterrupt"]
