"""``python -m workbench.worker PRESET_OR_CONFIG --run-dir DIR``: the training worker, as ``workbench
train`` runs it (``workbench.worker.cli``) but without the planner: ``"auto"`` limits resolve with an
activation peak of 0 until the trace step measures one (``backend/workbench/cli/train.py``)."""

import sys

from workbench.worker.preload import WORKER_LIBRARIES, import_frozen

import_frozen(("workbench.worker.cli", *WORKER_LIBRARIES))  # collector paused, then frozen

from workbench.worker.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
