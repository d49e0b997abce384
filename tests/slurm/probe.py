"""Topology probe run as a SLURM job: rank 0 prints every rank's view as JSON."""
import json
import os

import hvdlite as hvd
from hvdlite.api import runtime

hvd.init()
view = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(), "node": os.environ.get("SLURMD_NODENAME"),
        "source": runtime.RUNTIME.topology.source}
views = hvd.allgather_object(view)
if hvd.rank() == 0:
    print("PROBE " + json.dumps(views), flush=True)
