"""Create-if-absent on S3 and S3-compatible stores: a PUT with `If-None-Match: *`, which
S3 has kept since 2024 (MinIO, R2 and moto keep it too). What needs a first-writer-wins
object on a store without atomic rename uses it: the run id a job mints at its first
start (`pipeline.catalog.run_identity`) and the probe that a store keeps the condition
Delta commits by (`pipeline.catalog.delta_table.check_commits_are_safe`).

Requests are signed here (AWS Signature Version 4, unsigned payload) with the credentials
delta-rs would use: the URI's user info or parameters, else the environment. pyarrow's
S3 filesystem, which lorp's `Storage` reads and writes through, sends no conditions.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import urllib.error
import urllib.request
from datetime import UTC, datetime
from urllib.parse import quote, urlsplit

from pipeline.storage.store import delta_location

CREATED, PRESENT = True, False


def is_s3(location: str) -> bool:
    return str(location).startswith(("s3://", "s3a://"))


def put_if_absent(location: str, rel: str, data: bytes) -> bool:
    """Write `data` at `rel` below the S3 `location` unless an object is there: True when
    this call created it, False when one was there (written by whoever came first).
    OSError (one line, naming the HTTP status) for any other answer."""
    endpoint, bucket, key, options = _target(location, rel)
    status = _request("PUT", endpoint, bucket, key, options, data, {"If-None-Match": "*"})
    if status == 200:
        return CREATED
    if status in (409, 412):  # 412 Precondition Failed; 409 a concurrent PUT of the key
        return PRESENT
    raise OSError(f"a conditional PUT of {key!r} answered HTTP {status}")


def delete(location: str, rel: str) -> None:
    endpoint, bucket, key, options = _target(location, rel)
    status = _request("DELETE", endpoint, bucket, key, options, None, {})
    if status not in (200, 204, 404):
        raise OSError(f"a DELETE of {key!r} answered HTTP {status}")


def endpoint_of(location: str) -> str | None:
    """The endpoint a location overrides (a MinIO, R2 or moto server); None for AWS."""
    return delta_location(location)[1].get("AWS_ENDPOINT_URL")


def _target(location: str, rel: str) -> tuple[str, str, str, dict[str, str]]:
    uri, options = delta_location(location)
    bucket, _, prefix = uri.split("://", 1)[1].partition("/")
    key = "/".join(p for p in (prefix.strip("/"), rel.strip("/")) if p)
    region = _setting(options, "AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1"
    endpoint = _setting(options, "AWS_ENDPOINT_URL") or f"https://s3.{region}.amazonaws.com"
    return endpoint, bucket, key, options


def _setting(options: dict[str, str], name: str, env: str | None = None) -> str:
    return options.get(name) or os.environ.get(env or name, "")


def _request(
    method: str,
    endpoint: str,
    bucket: str,
    key: str,
    options: dict[str, str],
    data: bytes | None,
    extra: dict[str, str],
) -> int:
    """One signed path-style request; its HTTP status. OSError where nothing answered."""
    path = "/" + quote(f"{bucket}/{key}")
    headers = _signed_headers(method, endpoint, path, options)
    if data is not None:  # urllib's default is a form, which a server may parse away
        headers["Content-Type"] = "application/octet-stream"
    request = urllib.request.Request(
        endpoint.rstrip("/") + path, data=data, method=method, headers={**headers, **extra}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _signed_headers(
    method: str, endpoint: str, path: str, options: dict[str, str]
) -> dict[str, str]:
    """AWS Signature Version 4 headers for an unsigned-payload S3 request."""
    region = _setting(options, "AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1"
    now = datetime.now(UTC)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    headers = {
        "host": urlsplit(endpoint).netloc,
        "x-amz-content-sha256": "UNSIGNED-PAYLOAD",
        "x-amz-date": stamp,
    }
    if token := _setting(options, "AWS_SESSION_TOKEN"):
        headers["x-amz-security-token"] = token
    names = ";".join(sorted(headers))
    canonical = "\n".join(
        [
            method,
            path,
            "",
            *(f"{k}:{headers[k]}" for k in sorted(headers)),
            "",
            names,
            "UNSIGNED-PAYLOAD",
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    signing = f"AWS4{_setting(options, 'AWS_SECRET_ACCESS_KEY')}".encode()
    for part in (day, region, "s3", "aws4_request"):
        signing = hmac.new(signing, part.encode(), hashlib.sha256).digest()
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{digest}"
    signature = hmac.new(signing, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={_setting(options, 'AWS_ACCESS_KEY_ID')}/{scope}, "
        f"SignedHeaders={names}, Signature={signature}"
    )
    return headers
