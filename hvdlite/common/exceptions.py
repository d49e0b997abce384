"""``from horovod.common.exceptions import HorovodInternalError`` becomes
``from hvdlite.common.exceptions import ...``: the same classes as hvdlite.errors."""
from hvdlite.errors import (CollectiveFailedError, HorovodInternalError, HostsUpdatedError,
                            HostsUpdatedInterrupt)

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "CollectiveFailedError",
           "HostsUpdatedError"]
