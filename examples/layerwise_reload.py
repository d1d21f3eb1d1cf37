"""The bug that started this project, end to end on CPU: run ``python examples/layerwise_reload.py``.

A layerwise deferred loader (vLLM's online-quantization reload, reproduced
small in ``sanitizer/testing/reference/deferred_loader.py``) retains borrowed views of a staging
ring until each layer is complete; the ring has moved on by then. The demo
says what it simulates, loads a real ``.safetensors`` checkpoint five ways
(unsafe, debug mode, clone-on-defer, rescue, copy-everything) and prints a
table of corrupted tensors, errors raised, load time and peak extra memory,
then the fix (``own_arguments`` at the deferral, with its line), debug mode's
report with which frames are the consumer's, and a run with ``triage=1``
whose JSON report (``--report``, for ``ownsan triage``) and timeline page
(``--html``) it writes. ``--help`` lists the size and order options. The
implementation is ``sanitizer/testing/demo.py``; ``ownsan demo`` runs the same.

``ownsan audit examples`` finds nothing in this file because it holds no consumer, only the demo's entry:
the retaining consumer is the reference loader, and ``ownsan audit sanitizer/testing/reference`` finds it
(OWN104 at ``info.loaded_weights.append((param_name, bound))`` in ``online_process_loader``, the line the
demo's fix and its report name).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sanitizer.testing.demo import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
