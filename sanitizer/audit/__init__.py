"""``ownsan audit``: a static auditor for retaining consumers of borrowed weight tensors.

It reads Python source with the standard library's :mod:`ast` (no LibCST: the audit reports, it does
not rewrite, and ``ast`` is fast and always there), never imports the audited code and never imports
torch. It finds the functions that consume weights (weights iterators, per-tensor loaders, known
producers), follows each yielded tensor and everything that shares its memory, and reports every
statement that keeps one past the loader's step. See ``docs/audit.md``.

Modules, one job each: :mod:`.sources` (files in), :mod:`.index` (a module's functions and classes),
:mod:`.discovery` (which functions consume weights), :mod:`.vocabulary` (what each operation means for
memory), :mod:`.values`/:mod:`.flow` (the taint/alias flow), :mod:`.targets` and :mod:`.lifetimes`
(escape detection), :mod:`.summaries` (calls into helpers), :mod:`.suppression`, :mod:`.formats`,
:mod:`.crosscheck` (a runtime report against the findings), :mod:`.cli`, :mod:`.flake8_plugin`.
"""
from __future__ import annotations

from sanitizer.audit.codes import CODES
from sanitizer.audit.engine import AuditResult, audit_paths, audit_text
from sanitizer.audit.findings import Finding, Link
from sanitizer.audit.sources import AuditInputError

__all__ = ["CODES", "AuditResult", "AuditInputError", "Finding", "Link", "audit_paths", "audit_text"]
