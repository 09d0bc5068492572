"""The plain layout reference of the tests reproduces the documented examples and padding rules."""

from __future__ import annotations

from tests.layout_reference import dense_positions, padded_lengths, thd_positions


def test_reference_reproduces_design_examples():
    positions, offsets = thd_positions([0, 3, 8], None, 2, 1)
    assert positions == [[0, -1, 3, 4, -1, -1], [1, 2, 5, 6, 7, -1]]
    assert offsets == [0, 4, 12]
    assert dense_positions("zigzag", 2, 1, 8) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert dense_positions("zigzag", 2, 2, 8) == [[0, 1], [6, 7], [2, 3], [4, 5]]


def test_reference_sequence_parallel_padding_divides_by_tp():
    for cp, tp, lengths in ((2, 3, [3, 5]), (3, 2, [1]), (4, 4, [9, 1, 30])):
        padded = padded_lengths(lengths, cp, tp)
        assert all(p % (2 * cp) == 0 for p in padded)
        assert (sum(padded) // cp) % tp == 0
        assert padded[:-1] == [-(-x // (2 * cp)) * 2 * cp for x in lengths[:-1]]
