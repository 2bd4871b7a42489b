"""``python -m backend.cli``: the ``workbench`` command line."""

import sys

from backend.cli import main

sys.exit(main())
