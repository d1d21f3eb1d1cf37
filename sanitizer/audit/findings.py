"""What the audit reports: one :class:`Finding` per retaining statement, with the chain of steps that
led the yielded tensor there (so a reader can check the claim without re-deriving it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Link:
    """One step of a chain: where (line, function) and what happened there, in words."""

    line: int
    function: str
    text: str
    path: Optional[str] = None  # set when the link is in another file than the finding (an imported helper)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"line": self.line, "function": self.function, "text": self.text}
        if self.path is not None:
            out["path"] = self.path
        return out

    def render(self) -> str:
        return f"{self.text} ({self.path}:{self.line})" if self.path else f"{self.text} (line {self.line})"


@dataclass
class Finding:
    path: str
    line: int
    col: int  # 1-based, as flake8 and compilers print it
    end_line: int
    function: str  # qualified name of the function that holds the retaining statement
    code: str
    pattern: str
    message: str
    chain: Tuple[Link, ...]
    fix: str
    consumer: str = ""  # the weight-consuming function whose yielded tensor this is (differs through helpers)
    consumer_path: str = ""  # the file that function is in (another module's, through an imported helper)
    also_from: List[Tuple[str, str]] = field(default_factory=list)  # other (path, consumer) reaching it
    confirmed: Optional[bool] = None  # set by the --report cross-check
    confirmed_by: List[Dict[str, Any]] = field(default_factory=list)

    def merge(self, other: "Finding") -> None:
        """The same statement found again from another consumer: remember that consumer too."""
        for who in other.consumers:
            if who[1] and who not in self.consumers:
                self.also_from.append(who)

    @property
    def consumers(self) -> List[Tuple[str, str]]:
        """Every (path, function) whose yielded tensors reach this statement."""
        return [(self.consumer_path or self.path, self.consumer)] + self.also_from

    @property
    def key(self) -> Tuple[str, int, int, str]:
        return (self.path, self.line, self.col, self.code)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "path": self.path, "line": self.line, "col": self.col, "end_line": self.end_line,
            "function": self.function, "code": self.code, "pattern": self.pattern, "message": self.message,
            "chain": [link.to_json() for link in self.chain], "fix": self.fix, "consumer": self.consumer,
            "also_from": [{"path": p, "function": f} for p, f in self.also_from],
        }
        if self.confirmed is not None:
            out["confirmed"] = self.confirmed
            out["confirmed_by"] = list(self.confirmed_by)
        return out


__all__ = ["Link", "Finding"]
