"""``python -m sanitizer.audit PATH...``: the auditor alone (the same as ``ownsan audit``)."""
import sys

from sanitizer.audit.cli import main

sys.exit(main(prog="python -m sanitizer.audit"))
