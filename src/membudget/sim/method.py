"""A method under comparison: a policy, the pool it runs on and its in-place mode.

Written ``policy[@allocator][+inplace]`` on the command line, e.g. ``coop`` (Coop as
published: two-sided pool, recomputable in-place), ``coop@best-fit`` (no partitioning),
``coop+cow`` (copy-on-write) or ``dte@two-sided+remat`` (Coop without its window). Where
victims go (``swap``: see the engine) comes from its own option and is named after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from membudget.errors import MembudgetError

# Coop's ablations as the paper names them.
ABLATIONS = {
    "coop-no-partition": "coop@best-fit",
    "coop-cow": "coop+cow",
    "coop-no-window": "dte@two-sided+remat",
}


@dataclass(frozen=True)
class Method:
    """``allocator`` and ``inplace`` None mean the policy's published defaults."""

    policy: str
    allocator: str | None = None
    inplace: str | None = None
    label: str = ""
    swap: str = "off"

    @classmethod
    def parse(cls, text: str, allocator: str | None = None,
              inplace: str | None = None) -> Method:
        """Parse ``policy[@allocator][+inplace]`` or an ablation name; ``allocator`` and
        ``inplace`` fill in what the text leaves out."""
        text = text.strip()
        spec = ABLATIONS.get(text, text)
        rest, _, inp = spec.partition("+")
        pol, _, alloc = rest.partition("@")
        if not pol or "@" in alloc or "+" in inp:
            raise MembudgetError(f"bad method {text!r}: write policy[@allocator][+inplace], "
                                 "e.g. coop@best-fit+cow")
        label = text if (allocator is None and inplace is None) else ""
        return cls(pol, alloc or allocator, inp or inplace, label)

    @property
    def name(self) -> str:
        name = self.label or (self.policy + (f"@{self.allocator}" if self.allocator else "")
                              + (f"+{self.inplace}" if self.inplace else ""))
        return name if self.swap == "off" else f"{name} swap:{self.swap}"
