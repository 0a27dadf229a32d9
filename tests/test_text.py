"""kvlab._text: counts with their nouns, signed figures without a "-0" (issue 22)."""
from kvlab._text import plural, signed


def test_plural():
    assert [plural(n, "slot") for n in (0, 1, 2)] == ["0 slots", "1 slot", "2 slots"]
    assert plural(1, "K/V head") == "1 K/V head" and plural(8, "K/V head") == "8 K/V heads"
    assert plural(3, "sequence", "sequences") == "3 sequences"
    assert plural(2, "child", "children") == "2 children"
    assert plural(1, "child", "children") == "1 child"


def test_signed_has_no_negative_zero():
    assert signed(-0.00044, 3) == "+0.000" and signed(-0.0, 2) == "+0.00"
    assert signed(0.0, 3) == "+0.000"
    assert signed(-0.0005001, 3) == "-0.001" and signed(0.0004, 3) == "+0.000"
    assert signed(1.5, 1) == "+1.5" and signed(-1.5, 1) == "-1.5"
