"""``python -m workbench.cli``: the ``workbench`` command line."""

import sys

from workbench.cli import main

sys.exit(main())
