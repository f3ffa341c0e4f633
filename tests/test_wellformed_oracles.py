"""training/text/wellformed.py on hand-built inputs (#46 item 3, the `wellformed` mutation target), from the module's
requirements: strict UTF-8 decoding by Unicode's maximal-subpart rule (an incomplete sequence at the end
held back unless final), SentencePiece-style byte markers, stray marks extending the cluster before them,
joiners stray only beside Bengali, shares of 1.0 for text with nothing Bengali, and at most 10 examples."""

from __future__ import annotations

from training.text.wellformed import (
    MAX_EXAMPLES,
    WellFormed,
    byte_marker,
    clusters,
    decode_utf8,
    is_bengali,
    wellformed,
)

KA, AA, VIRAMA, ZWJ, ZWNJ = "\u0995", "\u09be", "\u09cd", "\u200d", "\u200c"


def test_decode_utf8_valid_text_is_itself() -> None:
    got = decode_utf8("বাংলা ok".encode())
    assert (got.text, got.invalid, got.pending) == ("বাংলা ok", (), b"")


def test_decode_utf8_drops_or_marks_each_maximal_invalid_subpart() -> None:
    data = b"a\xe0\xa6b\xffc"  # a truncated 3-byte sequence (E0 A6), then a lone FF
    got = decode_utf8(data)
    assert (got.text, got.invalid, got.pending) == ("abc", (b"\xe0\xa6", b"\xff"), b"")
    marked = decode_utf8(data, mark=byte_marker)
    assert marked.text == "a<0xE0><0xA6>b<0xFF>c" and marked.invalid == (b"\xe0\xa6", b"\xff")


def test_an_incomplete_sequence_at_the_end_waits_unless_final() -> None:
    data = "ক".encode() + "খ".encode()[:2]
    got = decode_utf8(data, final=False)
    assert (got.text, got.invalid, got.pending) == ("ক", (), "খ".encode()[:2])
    done = decode_utf8(data)  # final: the same bytes are invalid
    assert (done.text, done.invalid, done.pending) == ("ক", ("খ".encode()[:2],), b"")
    # an invalid sequence before the end is dropped even when not final, and the tail still waits
    mid = decode_utf8(b"\xffx" + "খ".encode()[:1], final=False)
    assert (mid.text, mid.invalid, mid.pending) == ("x", (b"\xff",), b"\xe0")


def test_byte_marker_names_each_byte_in_upper_hex() -> None:
    assert byte_marker(b"\xe0\x0a") == "<0xE0><0x0A>"
    assert byte_marker(b"") == ""


def test_is_bengali_is_the_block_inclusive() -> None:
    assert is_bengali("\u0980") and is_bengali("\u09ff")
    assert not is_bengali("\u097f") and not is_bengali("\u0a00")


def test_stray_marks_extend_the_cluster_before_them_or_stand_alone() -> None:
    got = [(c.text, c.start, c.valid) for c in clusters(f"{KA}{AA}{AA}{VIRAMA} {AA}{AA}")]
    assert got == [(f"{KA}{AA}{AA}{VIRAMA}", 0, False), (f"{AA}{AA}", 5, False)]
    # a mark after a space does not reach back over it
    assert [(c.text, c.start) for c in clusters(f"{KA} {AA}")] == [(KA, 0), (AA, 2)]


def test_a_joiner_is_stray_only_beside_bengali() -> None:
    assert clusters(f"a{ZWJ}b") == []  # Latin (or emoji, Persian) joiners are not ours
    assert [(c.text, c.valid) for c in clusters(f"{KA}{ZWJ} ")] == [(f"{KA}{ZWJ}", False)]
    assert [(c.text, c.valid) for c in clusters(f" {ZWNJ}{KA}")] == [(ZWNJ, False), (KA, True)]
    assert [(c.text, c.valid) for c in clusters(f"{KA}{ZWJ}{VIRAMA}{KA}")] == [(f"{KA}{ZWJ}{VIRAMA}{KA}", True)]


def test_shares_counts_and_examples() -> None:
    assert WellFormed().share == 1.0 and wellformed("hello, 123").share == 1.0  # nothing Bengali to get wrong
    wf = WellFormed().add(f"{KA}{AA} {AA}\ufffd", invalid_bytes=2)
    assert (wf.clusters, wf.valid, wf.invalid_bytes, wf.share) == (2, 1, 3, 0.5)
    assert wf.to_dict() == {"share": 0.5, "clusters": 2, "invalid": 1, "invalid_bytes": 3, "examples": [AA]}
    many = wellformed([f"{chr(0x0995 + i)}{AA}{AA}" for i in range(12)] + [f"{KA}{AA}{AA}"] * 2)
    ex = many.to_dict()["examples"]
    assert MAX_EXAMPLES == 10 and len(ex) == 10 and ex[0] == f"{KA}{AA}{AA}"  # the most common first
    assert many.invalid[f"{KA}{AA}{AA}"] == 3 and many.clusters == 14 and many.valid == 0


def test_a_joiner_at_either_end_of_the_text_looks_only_inside_it() -> None:
    assert clusters(f"a{ZWJ}") == []  # the last character: nothing after it to look at
    assert [(c.text, c.start) for c in clusters(f"{ZWJ}a{KA}")] == [(KA, 2)]  # the first: nothing before it


def test_a_stray_mark_does_not_swallow_the_digits_after_it() -> None:
    assert [(c.text, c.valid) for c in clusters(f"{AA}\u09e7\u09e8")] == [(AA, False)]  # ১২ are not letters


def test_invalid_bytes_add_up_over_texts_and_default_to_none() -> None:
    wf = WellFormed().add("x")
    assert wf.invalid_bytes == 0
    wf.add("\ufffd", invalid_bytes=2).add("y", invalid_bytes=1)
    assert wf.invalid_bytes == 4
