"""usage's cached_tokens counts an image only for the salt that sent it before (decoder_service/image_hits.py)."""
from __future__ import annotations

from decoder_service.image_hits import SaltedHits

ROWS = ((0, 64),)


def test_held_rows_count_only_where_the_same_salt_sent_the_item_before() -> None:
    hits = SaltedHits()
    assert hits.visible("a", ["x"], [ROWS]) == [()]  # A's first: nothing of A's was held
    assert hits.visible("b", ["x"], [ROWS]) == [()]  # B: held by the fleet, but not B's
    assert hits.visible("", ["x"], [ROWS]) == [()]
    assert hits.visible("a", ["x", "y"], [ROWS, ROWS]) == [ROWS, ()]
    assert hits.visible("", ["x"], [ROWS]) == [ROWS]
    assert hits.visible("a", ["y"], [()]) == [()]  # not held: nothing to count, whoever sent it


def test_the_pairs_are_bounded_and_the_oldest_are_forgotten() -> None:
    hits = SaltedHits(capacity=2)
    for h in ("x", "y", "z"):
        hits.visible("a", [h], [ROWS])
    assert len(hits) == 2
    assert hits.visible("a", ["x", "z"], [ROWS, ROWS]) == [(), ROWS]  # x was forgotten: fewer cached, never more
