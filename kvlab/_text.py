"""Small helpers for the numbers the kit prints in its tables and summaries (issue 22):
a count with its noun in the right number, and a signed figure that never shows "-0"."""


def plural(n: int, word: str, many: str = "") -> str:
    """'1 slot', '0 slots', '6 slots': n with `word`, or with `many` (default word + 's')
    when n is not 1."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def signed(x: float, digits: int) -> str:
    """x with its sign and `digits` decimals, '+0.000' rather than '-0.000' for a value
    that rounds to zero (a change of nothing has no direction)."""
    text = f"{x:+.{digits}f}"
    return f"{0.0:+.{digits}f}" if float(text) == 0 else text
