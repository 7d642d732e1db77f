"""Fixtures the pipeline's unit tests share: a moto S3 server and a `Storage` on every
backend (local directory, file:// URI, S3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.storage.store import Storage
from tests.helpers.local_servers import (
    AWS_TEST_ENV,
    create_bucket,
    free_port,
    s3_location,
    start_moto,
)

BUCKET = "lorp"


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Any:  # type: ignore[no-untyped-def]
    """A moto S3 server on a free loopback port, a bucket, and dummy credentials in the
    environment (Ray workers started later inherit them). Yields the URI of the bucket."""
    port = free_port()
    server = start_moto(port, tmp_path_factory.mktemp("moto") / "moto.log")
    env = AWS_TEST_ENV | {"MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}  # MLflow's (boto3)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        create_bucket(port, BUCKET)
        yield s3_location(port, BUCKET, "{prefix}")
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(params=["local", "file", "s3"])
def store(request, tmp_path: Path) -> Storage:  # type: ignore[no-untyped-def]
    if request.param == "local":
        return Storage(tmp_path / "store")
    if request.param == "file":
        return Storage((tmp_path / "store").as_uri())
    uri = request.getfixturevalue("s3")
    return Storage(uri.format(prefix=f"unit/{tmp_path.name}"))
