from dlstore.write.sizes import count, human_bytes


def test_counts_read_as_english() -> None:
    assert count(1, "worker") == "1 worker" and count(2, "worker") == "2 workers"
    assert count(1, "class", "classes") == "1 class" and count(0, "class", "classes") == "0 classes"
    assert count(12345, "file") == "12,345 files"


def test_bytes_in_decimal_units() -> None:
    assert human_bytes(999) == "999 B" and human_bytes(1_234_567) == "1.2 MB"
