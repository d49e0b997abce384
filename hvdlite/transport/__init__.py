"""The world of ranks: who they are, and how bytes and small objects travel between them.

``base`` is the protocol the engine and the backends use; ``mpi_transport`` (mpi4py) and
``torch_transport`` (torch.distributed, with the node's shared memory in ``node_memory``)
implement it. ``waits`` and ``handoff`` are how a transport's own calls are waited on and
let go of; ``peers`` and ``topology`` say which process a rank is and where it runs.
Importing this package starts nothing: each transport imports its library in its own
module, loaded only inside ``hvdlite.init()``.
"""
