"""Entry point of one subprocess evaluator worker (see workers.py): `python -m specjax.search.worker`."""

import sys

from specjax.search.workers import worker_main

if __name__ == "__main__":
    sys.exit(worker_main())
