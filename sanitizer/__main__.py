"""``python -m sanitizer ...`` is ``ownsan ...`` (see :mod:`sanitizer.tools.cli`)."""
import sys

from sanitizer.tools.cli import main

sys.exit(main())
