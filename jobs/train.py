"""`ray job submit -- python jobs/train.py --config configs/<x>.yaml [--json] [--output result.json]`."""

import sys

from hetero_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
