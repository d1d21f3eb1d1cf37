"""The core scenario: a loader lends a view, reuses its bytes, a consumer reads it late.

Run: ``python examples/quickstart.py``. The program itself is
:mod:`sanitizer.testing.quickstart` (importable, so that ``ownsan demo`` can run it too).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sanitizer.testing.quickstart import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
