"""`ray start` for raylets that register as 127.0.0.1: ``python -m hetero_ray.cluster.ray_start_loopback start …``.

Ray on Linux replaces ``--node-ip-address=127.0.0.1`` with the machine's interface
address (``services.resolve_ip_for_localhost``), so an emulated cluster's GCS, object
managers and agents would talk over that interface. Ray's own switch for loopback-only
clusters, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (which the emulated cluster sets for
every process, so drivers and workers pick 127.0.0.1 too), also makes `ray start` refuse
to add a second node. This entry point keeps the given address and lets nodes join;
everything else is Ray's own `ray start`.
"""

import sys

import ray._private.ray_constants as ray_constants
import ray._private.services as services
from ray.scripts.scripts import main

if __name__ == "__main__":
    ray_constants.ENABLE_RAY_CLUSTER = True
    services.resolve_ip_for_localhost = lambda host: host
    sys.exit(main())
