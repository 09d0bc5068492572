"""``python -m lightning_cp``: the ``lightning-cp`` console script."""

import sys

from lightning_cp.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
