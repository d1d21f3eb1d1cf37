"""The audit's finding codes: one table that the output formats, the docs, the flake8 plugin and
``--select/--ignore`` (:mod:`sanitizer.audit.selection`) all read, so a code means the same thing everywhere.

A *retention* (OWN101-OWN106) keeps a tensor that a weight loader yielded, or something that shares its
memory, past the step that yielded it: a borrowing loader (InstantTensor, fastsafetensors, runai) may
overwrite those bytes as soon as it is asked for the next tensor. OWN120 is not a retention: it is a
write into the yielded tensor itself, that is into the loader's (possibly shared) staging buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

OWN_FIX = "own it where it is kept: `sanitizer.own(t)` or `t.clone()`"


@dataclass(frozen=True)
class Code:
    code: str
    name: str  # a short slug, also the SARIF rule name
    meaning: str
    fix: str
    # One whole sentence, distinct per code: SARIF's rule title (``shortDescription``, what code scanning lists).
    # A title cut out of ``meaning`` at its first parenthesis or colon made OWN101 and OWN102 both read
    # "a yielded tensor".
    title: str


CODES: Dict[str, Code] = {c.code: c for c in (
    Code("OWN101", "container-store",
         "a yielded tensor (or a view of it) is stored in a container that outlives the loader's step "
         "(a side list, a dict by name, a tensor parked until its partner arrives)",
         OWN_FIX,
         title="A yielded tensor is stored in a container that outlives the loader's step."),
    Code("OWN102", "attribute-store",
         "a yielded tensor (or a view of it) is stored in an attribute of an object that outlives the step "
         "(`self.x = t`, `param.data = t`, `setattr`, `nn.Parameter(t)` kept on a module)",
         OWN_FIX,
         title="A yielded tensor is stored in an attribute of an object that outlives the loader's step."),
    Code("OWN103", "materialised-iterator",
         "the weights iterator is materialised: `list`/`dict`/`tuple`/`sorted`/`set`, a comprehension that "
         "keeps the tensors, or `itertools.tee`, so every tensor is kept while the loader moves on",
         "iterate once and consume each tensor in its step; if all are needed at once, own each one as it "
         "arrives: `[(n, sanitizer.own(t)) for n, t in weights]`",
         title="The weights iterator is materialised, so every tensor is kept while the loader moves on."),
    Code("OWN104", "deferred-capture",
         "a yielded tensor is captured for a deferred call: a closure or lambda, `functools.partial`, or "
         "`inspect.BoundArguments` (`sig.bind(...)`) that outlives the step",
         "own the arguments before deferring: `sanitizer.own_arguments(bound)`, `sanitizer.own(t)` or "
         "`t.clone()`",
         title="A yielded tensor is captured for a deferred call that outlives the loader's step."),
    Code("OWN105", "kept-variable",
         "a local variable keeps a yielded tensor past its step: it is read after the loop or by a later "
         "iteration (the loader has moved on by then)",
         OWN_FIX,
         title="A local variable keeps a yielded tensor past the loader's step."),
    Code("OWN106", "global-store",
         "a yielded tensor is stored in a global, class-level or enclosing-scope (`nonlocal`) name",
         OWN_FIX,
         title="A yielded tensor is stored in a global, class-level or nonlocal name."),
    Code("OWN107", "conditional-retention",
         "stored where it outlives the step (as OWN101/OWN102/OWN106) through a conversion that is a no-op when "
         "nothing needs converting (`.contiguous()`, `.to(dtype)`, `.cuda()`): a retention when the loaded "
         "tensor is already in place, a copy otherwise",
         "own it where it is kept, or make the copy explicit: `sanitizer.own(t)` or `t.clone()`",
         title="A yielded tensor is stored past the loader's step through a conversion that returns the tensor "
               "itself when nothing needs converting."),
    Code("OWN120", "inplace-write",
         "an in-place write into a yielded tensor (`t.mul_()`, `t.copy_(x)`, `t[...] = x`, `t += x`, "
         "`out=t`): with a borrowing loader that writes into the loader's staging buffer",
         "write into an owned copy: `t = t.clone()` (or `sanitizer.own(t)`) before modifying it",
         title="A yielded tensor is written in place, into the loader's staging buffer."),
)}

RETENTION_CODES = tuple(c for c in CODES if c != "OWN120")


class CodeSelectionError(ValueError):
    """A --select/--ignore value that names no code (:mod:`sanitizer.audit.selection` reads them)."""


__all__ = ["Code", "CODES", "RETENTION_CODES", "OWN_FIX", "CodeSelectionError"]
