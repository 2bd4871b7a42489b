"""``python -m workbench.worker PRESET_OR_CONFIG --run-dir DIR``: the training worker, as ``workbench
train`` runs it (``workbench.worker.cli``) but without the planner: ``"auto"`` limits resolve with an
activation peak of 0 until the trace step measures one (``backend/workbench/cli/train.py``)."""

import sys

from workbench.worker.cli import main

if __name__ == "__main__":
    sys.exit(main())
