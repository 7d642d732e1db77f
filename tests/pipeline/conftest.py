"""Fixtures the pipeline's unit tests share: a moto S3 server and a `Storage` on every
backend (local directory, file:// URI, S3)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from pipeline.storage import Storage
from tests.helpers.local_servers import free_port, wait_for_port

BUCKET = "lorp"


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Any:  # type: ignore[no-untyped-def]
    """A moto S3 server on a free loopback port, a bucket, and dummy credentials in the
    environment (Ray workers started later inherit them). Yields the URI of the bucket."""
    import moto.server  # noqa: F401  (make test installs it: a missing one fails)

    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    wait_for_port(port, server, log, "moto server", timeout=60)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",  # MLflow's artifacts (boto3)
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        options = {"endpoint_override": f"127.0.0.1:{port}", "scheme": "http"}
        pafs.S3FileSystem(**options, allow_bucket_creation=True).create_dir(BUCKET)
        yield f"s3://{BUCKET}/{{prefix}}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
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
