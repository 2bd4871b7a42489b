"""``python -m worker PRESET_OR_CONFIG --run-dir DIR``: the training worker, the same as
``workbench train`` (``worker.cli``)."""

import sys

from worker.cli import main

if __name__ == "__main__":
    sys.exit(main())
