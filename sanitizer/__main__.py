"""``python -m sanitizer ...`` is ``ownsan ...`` (see :mod:`sanitizer.cli`)."""
import sys

from .cli import main

sys.exit(main())
