"""Type checks shared by the validation of user-facing settings (no torch)."""

import math


def is_integer(value: object) -> bool:
    """An int that is not a bool (`True` is an int to Python, but no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """An int or float, not a bool, that is finite as a float (10**400 is not: it overflows)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
