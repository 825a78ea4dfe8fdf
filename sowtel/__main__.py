"""``python -m sowtel``: the same as the ``sowtel`` command."""

import sys

from sowtel.cli import main

sys.exit(main())
