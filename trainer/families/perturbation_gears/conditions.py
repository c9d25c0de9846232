"""GEARS' condition grammar: 'ctrl', 'A+ctrl' / 'ctrl+A' (a single), 'A+B' (a double).

A condition's canonical form is the tuple of its perturbed genes, sorted: `()` for the control,
`('A',)` for a single, `('A', 'B')` for a double. 'A+ctrl' and 'ctrl+A' are the same condition, as
are 'A+B' and 'B+A' (GEARS keeps them apart as two strings; we merge them). `format_condition`
writes the canonical GEARS string back: 'ctrl', 'A+ctrl', 'A+B' (genes sorted).
"""

from __future__ import annotations

from collections.abc import Iterable

from trainer.errors import DataError

CTRL = "ctrl"
"""GEARS' name of the control condition (and of the 'no gene' slot of a single)."""

Condition = tuple[str, ...]
"""Canonical condition: sorted gene names; () is the control."""


def parse_condition(text: str, where: str = "") -> Condition:
    """The canonical form of a GEARS condition string; DataError naming the condition and why if malformed.

    `where` (e.g. "data.h5ad, obs['condition']") is put in front of the message.
    """
    prefix = f"{where}: " if where else ""
    if not isinstance(text, str):
        raise DataError(f"{prefix}condition {text!r}: not a string (got {type(text).__name__})")
    if text == CTRL:
        return ()
    if not text:
        raise DataError(f"{prefix}condition {text!r}: empty condition string")
    if text != text.strip() or any(c.isspace() for c in text):
        raise DataError(f"{prefix}condition {text!r}: contains whitespace (GEARS writes 'A+ctrl' or 'A+B')")
    parts = text.split("+")
    if len(parts) != 2:
        raise DataError(f"{prefix}condition {text!r}: expected 'ctrl', 'A+ctrl', 'ctrl+A' or 'A+B', "
                        f"got {len(parts)} part(s) separated by '+'")
    if "" in parts:
        raise DataError(f"{prefix}condition {text!r}: empty gene name")
    genes = [p for p in parts if p != CTRL]
    if not genes:
        raise DataError(f"{prefix}condition {text!r}: 'ctrl+ctrl' is not a condition (write 'ctrl')")
    if len(genes) == 2 and genes[0] == genes[1]:
        raise DataError(f"{prefix}condition {text!r}: the same gene twice")
    return tuple(sorted(genes))


def format_condition(condition: Condition) -> str:
    """GEARS' string of a canonical condition: 'ctrl', 'A+ctrl' or 'A+B' (sorted)."""
    if len(condition) == 0:
        return CTRL
    if len(condition) == 1:
        return f"{condition[0]}+{CTRL}"
    if len(condition) == 2:
        a, b = sorted(condition)
        return f"{a}+{b}"
    raise ValueError(f"a condition has 0, 1 or 2 genes, got {condition!r}")


def as_condition(value: str | Iterable[str]) -> Condition:
    """A canonical condition from a GEARS string or from a gene list (['A'], ['A', 'B'], [] for ctrl)."""
    if isinstance(value, str):
        return parse_condition(value)
    genes = [g for g in value if g != CTRL]
    if len(genes) > 2 or any(not isinstance(g, str) or not g or g != g.strip() for g in genes):
        raise DataError(f"condition {list(value)!r}: expected at most two non-empty gene names")
    if len(genes) == 2 and genes[0] == genes[1]:
        raise DataError(f"condition {list(value)!r}: the same gene twice")
    return tuple(sorted(genes))


def condition_genes(conditions: Iterable[Condition]) -> list[str]:
    """Sorted unique genes of `conditions`."""
    return sorted({g for c in conditions for g in c})


def dose_value(condition_text: str) -> str:
    """GEARS' `dose_val`: '1+1' for any string with a '+' (singles too), else '1'."""
    return "1+1" if len(condition_text.split("+")) == 2 else "1"


def condition_name(cell_type: str, condition_text: str) -> str:
    """GEARS' `condition_name`: f"{cell_type}_{condition}_{dose_val}" (the keys of its `uns` DE fields)."""
    return f"{cell_type}_{condition_text}_{dose_value(condition_text)}"
