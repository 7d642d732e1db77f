"""Create-if-absent on S3 (`pipeline.storage.s3_conditional`), against moto's S3 server."""

from __future__ import annotations

import time

import pytest

from pipeline.storage import s3_conditional
from pipeline.storage.store import Storage


def test_the_first_put_creates_and_the_second_finds_it(s3: str) -> None:
    location = s3.format(prefix=f"cond/{time.time_ns()}")
    assert s3_conditional.put_if_absent(location, "a/run.json", b"first") is True
    assert s3_conditional.put_if_absent(location, "a/run.json", b"second") is False
    assert Storage(location).read_bytes("a/run.json") == b"first"
    s3_conditional.delete(location, "a/run.json")
    assert s3_conditional.put_if_absent(location, "a/run.json", b"third") is True


def test_an_answer_s3_never_gives_is_one_line_naming_it(s3: str) -> None:
    missing = s3.format(prefix="x").replace("s3://lorp/", "s3://no-such-bucket/")
    with pytest.raises(OSError, match=r"^a conditional PUT of 'x/k' answered HTTP 404$"):
        s3_conditional.put_if_absent(missing, "k", b"")
