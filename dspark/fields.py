"""Type checks of user-given values (request fields, config.json fields, CLI flags): a ValueError naming the field."""
from __future__ import annotations


def check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """value as an integer (not a bool) in [lo, hi) where given."""
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo) \
            or (hi is not None and value >= hi):
        want = "an integer" if lo is None else f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi})"
        raise ValueError(f"{name}: expected {want}, got {value!r}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    return value
