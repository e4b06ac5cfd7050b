"""`ray job submit -- python jobs/profile_gpus.py --history profiles.parquet [--workload gpt --options '{…}'] [--json]`.

Profiles the workload on one device of every GPU type of the cluster (label
``hetero-ray/gpu-type``) and appends the rows to the history file; see
``hetero-ray profile --help`` for every option.
"""

import sys

from hetero_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["profile", *sys.argv[1:]]))
