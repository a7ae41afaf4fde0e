"""``tests/_launch.unmix``: the lines of ranks that share one pipe, put back."""

from __future__ import annotations

from tests._launch import json_lines, unmix


def test_a_line_that_landed_inside_another_is_put_back() -> None:
    # As CI printed it: rank 1's RESULT between rank 0's text and its newline.
    mixed = (
        "LOSS 0 1.410495\nLOSS val0 1.377412\n"
        'LOSS 1 1.321341RESULT {"rank": 1, "synced": 6}\n\n'
        'LOSS val1 1.348009\nRESULT {"rank": 0, "synced": 6}\n'
    )
    clean = unmix(mixed, ("LOSS ", "RESULT "))
    assert [r["rank"] for r in json_lines(clean)] == [1, 0]
    assert "LOSS 1 1.321341\nRESULT " in clean
    # Lines already whole are left as they were.
    whole = "LOSS 0 1.5\nRESULT {}\nother text\n"
    assert unmix(whole, ("LOSS ", "RESULT ")) == whole
