"""Where a job's results live for every node of the cluster: a local or shared directory,
or a URI that `pyarrow.fs` opens (`file://`, `s3://bucket/prefix`, `gs://`, `hdfs://`).
Query parameters configure the filesystem
(`s3://bucket/prefix?endpoint_override=127.0.0.1:9000&scheme=http`); credentials come from
the environment (AWS_ACCESS_KEY_ID, ...), which Ray workers inherit from the node.

What goes there: pruned checkpoints (uploaded by the node that made them), the catalog and
the events (the driver's run directory is a working copy, synced after every point), the
cached S files and loss-guided selections (when the job sets `storage` and not
`cache_dir`), MLflow artifacts, and the dashboard when `lorp dashboard --out` names it.

How a write becomes visible, so that no reader ever takes half of one:
- a directory on a filesystem (a local or shared path, `file://`) is written under a
  temporary dot-name and renamed into place (`lorp.atomic`): it exists only complete;
- a directory anywhere else (object stores, HDFS) gets every file first and the marker
  `_LORP_COMPLETE` (its file list) LAST; a rewrite deletes the marker first. Readers
  ignore (`complete`, `list`) or refuse (`get_dir`) a prefix without its marker: its
  writer died, or is still writing;
- a single file goes to a temporary dot-name and is then moved over the target (on S3 and
  GCS a server-side copy, which lands whole): readers see the old file or the new one.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import pyarrow.fs as pafs

from lorp.atomic import atomic_dir, atomic_file

MARKER = "_LORP_COMPLETE"
SCRATCH_ENV = "LORP_SCRATCH"


_CREDENTIAL = re.compile(r"secret|token|passw|key|credential|signature|sas", re.IGNORECASE)
"""A query parameter whose name says it carries a credential (`secret_key`,
`session_token`, `account_key`, `sas_token`, `client_secret`, ...)."""


def _public_query(query: str) -> str:
    """`query` without its credential parameters, the rest byte for byte as written."""
    kept = [kv for kv in query.split("&") if kv and not _CREDENTIAL.search(kv.partition("=")[0])]
    return "&".join(kept)


def redact(location: str) -> str:
    """`location` as records and messages show it: without `user:secret@` and without any
    query parameter that carries a credential. A local path is returned as it is."""
    if "://" not in location:
        return location
    p = urlsplit(location)
    return urlunsplit(
        (p.scheme, p.netloc.rpartition("@")[2], p.path, _public_query(p.query), p.fragment)
    )


def _scrub(message: str, location: str) -> str:
    """`message` with every credential `location` holds replaced by `***` (a library's
    error may quote the URI it was given)."""
    if "://" not in location:
        return message
    p = urlsplit(location)
    userinfo = p.netloc.rpartition("@")[0]
    secrets = [userinfo, userinfo.partition(":")[2]]  # user:secret, then the secret alone
    for kv in p.query.split("&"):
        key, _, value = kv.partition("=")
        if _CREDENTIAL.search(key):
            secrets.append(value)
    for secret in sorted({x for x in secrets if x}, key=len, reverse=True):
        message = message.replace(secret, "***")
    return message


def is_remote(location: str) -> bool:
    """A URI that is not a plain local path or `file://`."""
    return "://" in location and urlsplit(location).scheme not in ("", "file")


def unwritable(location: str) -> str | None:
    """Why this process cannot write below the local path `location` (a file in the way,
    no permission on the nearest directory that exists), or None: it can, or `location`
    is remote (an outage there is not bad input; its writes say so when they fail)."""
    if is_remote(location):
        return None
    path = Path(location.removeprefix("file://")).expanduser().resolve()
    nearest = path
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        return f"{str(nearest)!r} is a file, not a directory"
    if not os.access(nearest, os.W_OK | os.X_OK):
        return f"no permission to write in {str(nearest)!r}"
    return None


STORE_TIMEOUTS = {
    "timeout": "30s",
    "connect_timeout": "5s",
    "max_retries": "2",
    "retry_timeout": "10s",
}
"""Bounds on one call to an object store (delta-rs retries for 3 min by default): an
unreachable shared catalog costs a job's publisher seconds, not minutes."""
_S3_KEYS = {
    "endpoint_override": "AWS_ENDPOINT_URL",
    "region": "AWS_REGION",
    "access_key": "AWS_ACCESS_KEY_ID",
    "secret_key": "AWS_SECRET_ACCESS_KEY",
    "session_token": "AWS_SESSION_TOKEN",
}
"""pyarrow's S3 URI parameters (what lorp's storage URIs carry) as delta-rs options."""


def delta_location(location: str) -> tuple[str, dict[str, str]]:
    """delta-rs's URI and storage options for a storage location (the shared catalog,
    `pipeline.catalog.delta_table`); ValueError, one line, for a scheme Delta is not
    written to."""
    text = str(location)
    if "://" not in text or text.startswith("file://"):
        return str(Path(text.removeprefix("file://")).expanduser().resolve()), {}
    p = urlsplit(text)
    if p.scheme not in ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"):
        raise ValueError(
            f"catalog: {redact(text)!r}: Delta tables are not written to {p.scheme}://"
        )
    query = dict(parse_qsl(p.query))
    options = dict(STORE_TIMEOUTS)
    if p.scheme in ("s3", "s3a"):
        scheme = query.pop("scheme", "https")
        for key, value in query.items():
            name = _S3_KEYS.get(key, key)
            if name == "AWS_ENDPOINT_URL" and "://" not in value:
                value = f"{scheme}://{value}"
            options[name] = value
        if scheme == "http":
            options["AWS_ALLOW_HTTP"] = "true"
    else:
        options.update(query)
    userinfo, _, netloc = p.netloc.rpartition("@")
    if userinfo and p.scheme in ("s3", "s3a"):  # s3://KEY:SECRET@bucket/..., as pyarrow reads it
        user, _, password = userinfo.partition(":")
        options["AWS_ACCESS_KEY_ID"] = unquote(user)
        options["AWS_SECRET_ACCESS_KEY"] = unquote(password)
    return urlunsplit((p.scheme, netloc, p.path.rstrip("/"), "", "")), options


@functools.lru_cache(maxsize=32)
def _filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem for `location`, opened once per process: opening an S3 URI
    without `region=` asks the bucket's region over the network."""
    return pafs.FileSystem.from_uri(location)


@contextmanager
def scratch_dir() -> Iterator[Path]:
    """A node-local temporary directory (under $LORP_SCRATCH when set), removed on exit."""
    root = os.environ.get(SCRATCH_ENV)
    if root:
        Path(root).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lorp-", dir=root) as tmp:
        yield Path(tmp)


class Storage:
    """One storage location; `rel` paths below it use '/' whatever the backend."""

    def __init__(self, location: str | os.PathLike[str]) -> None:
        text = str(location)
        if not text.strip():
            raise ValueError("a storage location must be a non-empty path or URI")
        self.remote = is_remote(text)
        try:
            fs, root = _filesystem(text) if "://" in text else (None, text)
        except (OSError, ValueError) as exc:  # ArrowInvalid is a ValueError
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"{redact(text)!r} cannot be opened: {_scrub(reason, text)}") from None
        # `location` is what workers get: the absolute path, or the URI with every parameter.
        if self.remote:
            self.fs, self.root, self._parts = fs, root.rstrip("/"), urlsplit(text)
            self.location = text
        else:
            self.root_path = Path(root).expanduser().resolve()
            self.location = str(self.root_path)

    def __repr__(self) -> str:
        return f"Storage({self.uri()!r})"

    # -- names ---------------------------------------------------------------------------

    def uri(self, rel: str = "") -> str:
        """Where `rel` lives, for records: the absolute path on a filesystem, else the URI
        with its filesystem parameters but without credentials (`user:secret@`, or a
        parameter such as `secret_key=`: `redact`)."""
        return self._location(rel, secrets=False)

    def mlflow_uri(self, rel: str = "") -> str:
        """`rel` as MLflow's artifact stores name it: a file:// URI, or the URI without
        parameters or credentials (MLflow appends paths to it and reads its own settings
        from the environment: MLFLOW_S3_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)."""
        if not self.remote:
            return self._local(rel).as_uri()
        p = self._parts
        netloc = p.netloc.rpartition("@")[2]
        return urlunsplit((p.scheme, netloc, _join(p.path, rel, absolute=True), "", ""))

    def sub(self, rel: str) -> Storage:
        """The storage rooted at `rel` below this one."""
        return Storage(self._location(rel, secrets=True))

    def local_path(self, rel: str = "") -> Path | None:
        """The local path of `rel` on a filesystem storage; None for remote storage."""
        return None if self.remote else self._local(rel)

    def _location(self, rel: str, secrets: bool) -> str:
        if not self.remote:
            return str(self._local(rel))
        p = self._parts
        full = urlunsplit((p.scheme, p.netloc, _join(p.path, rel, absolute=True), p.query, ""))
        return full if secrets else redact(full)

    def _local(self, rel: str) -> Path:
        return self.root_path / rel if rel else self.root_path

    def _path(self, rel: str) -> str:
        return _join(self.root, rel, absolute=self.root.startswith("/"))

    # -- directories ---------------------------------------------------------------------

    def complete(self, rel: str = "") -> bool:
        """Whether the directory `rel` was written completely (see the module docstring)."""
        if not self.remote:
            return self._local(rel).exists()
        return self._read(f"{self._path(rel)}/{MARKER}") is not None

    def put_dir(self, src: str | os.PathLike[str], rel: str = "", *, replace: bool = True) -> str:
        """Copy the local directory `src` to `rel`, replacing what is there; its URI.
        `replace=False`, for content-addressed directories (the same name, the same
        bytes): what another writer put there is never removed, on a filesystem the first
        complete copy stays, on an object store each file is written again as it is."""
        src = Path(src)
        if not self.remote:
            try:
                with atomic_dir(self._local(rel), overwrite=replace) as tmp:
                    shutil.copytree(src, tmp, dirs_exist_ok=True)
            except FileExistsError:
                if replace:
                    raise
            return self.uri(rel)
        target = self._path(rel)
        if replace:
            self._delete(f"{target}/{MARKER}")  # a rewrite: incomplete from here on
            self.fs.delete_dir_contents(target, missing_dir_ok=True)
        files: dict[str, int] = {}
        for path in sorted(p for p in src.rglob("*") if p.is_file()):
            name = path.relative_to(src).as_posix()
            with path.open("rb") as fh:
                self._write(f"{target}/{name}", fh)
            files[name] = path.stat().st_size
        self._write_marker(target, files)
        return self.uri(rel)

    def _write_marker(self, target: str, files: dict[str, int]) -> None:
        """The marker, written after every file: from here on the prefix is complete."""
        self._write(f"{target}/{MARKER}", json.dumps({"files": files}, sort_keys=True).encode())

    def get_dir(self, rel: str, dest: str | os.PathLike[str], *, replace: bool = True) -> Path:
        """Copy the complete directory `rel` to the local `dest` (replaced atomically;
        `replace=False`: FileExistsError when another copy got there first)."""
        dest = Path(dest)
        if not self.remote:
            if not self._local(rel).is_dir():
                raise FileNotFoundError(f"{self.uri(rel)!r} does not exist")
            with atomic_dir(dest, overwrite=replace) as tmp:
                shutil.copytree(self._local(rel), tmp, dirs_exist_ok=True)
            return dest
        target, files = self._path(rel), self._listing(rel)
        with atomic_dir(dest, overwrite=replace) as tmp:
            for name, size in files.items():
                out = tmp / name
                out.parent.mkdir(parents=True, exist_ok=True)
                with self.fs.open_input_stream(f"{target}/{name}") as src, out.open("wb") as fh:
                    shutil.copyfileobj(src, fh, 1 << 23)
                if out.stat().st_size != size:
                    raise OSError(f"{self.uri(rel)!r}: {name} changed while it was read")
        return dest

    def _listing(self, rel: str) -> dict[str, int]:
        marker = self._read(f"{self._path(rel)}/{MARKER}")
        if marker is None:
            raise FileNotFoundError(
                f"{self.uri(rel)!r} is missing or incomplete (no {MARKER}: its writer died "
                "or is still writing)"
            )
        return dict(json.loads(marker)["files"])

    @contextmanager
    def fetched(self, rel: str = "") -> Iterator[Path]:
        """A local directory holding `rel`: the directory itself on a filesystem, else a
        node-local copy (under $LORP_SCRATCH) removed on exit."""
        if not self.remote:
            if not self._local(rel).exists():
                raise FileNotFoundError(f"{self.uri(rel)!r} does not exist")
            yield self._local(rel)
            return
        with scratch_dir() as tmp:
            yield self.get_dir(rel, tmp / "copy")

    def list(self, rel: str = "") -> list[str]:
        """Names directly under `rel`, temporaries left out. On remote storage a prefix
        is listed only with its marker (a directory `put_dir` finished), so parent
        prefixes such as `checkpoints/` are not; on a filesystem every directory is."""
        if not self.remote:
            d = self._local(rel)
            return sorted(p.name for p in d.iterdir() if p.name[0] != ".") if d.is_dir() else []
        selector = pafs.FileSelector(self._path(rel), allow_not_found=True)
        names = []
        for info in self.fs.get_file_info(selector):
            name = info.base_name
            if name.startswith(".") or name == MARKER:
                continue
            if info.type == pafs.FileType.Directory and not self.complete(_join(rel, name)):
                continue
            names.append(name)
        return sorted(names)

    def subdirs(self, rel: str = "") -> list[str]:
        """Every directory (prefix) directly under `rel`, incomplete and hidden ones
        included (a writer that died, a `.partial` copy): what `lorp gc` looks at."""
        if not self.remote:
            d = self._local(rel)
            return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []
        selector = pafs.FileSelector(self._path(rel), allow_not_found=True)
        infos = self.fs.get_file_info(selector)
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    def files(self, rel: str) -> dict[str, int]:
        """Every file below the directory `rel`, by its path relative to `rel`, with its
        size (no marker needed: a table's own log says what is whole)."""
        if not self.remote:
            d = self._local(rel)
            if not d.is_dir():
                return {}
            return {
                p.relative_to(d).as_posix(): p.stat().st_size for p in d.rglob("*") if p.is_file()
            }
        base = self._path(rel)
        selector = pafs.FileSelector(base, allow_not_found=True, recursive=True)
        infos = self.fs.get_file_info(selector)
        return {i.path[len(base) + 1 :]: i.size or 0 for i in infos if i.type == pafs.FileType.File}

    def tree_bytes(self, rel: str) -> int:
        """Bytes of every file below the directory `rel`."""
        if not self.remote:
            return sum(p.stat().st_size for p in self._local(rel).rglob("*") if p.is_file())
        selector = pafs.FileSelector(self._path(rel), allow_not_found=True, recursive=True)
        infos = self.fs.get_file_info(selector)
        return sum(i.size or 0 for i in infos if i.type == pafs.FileType.File)

    def delete_dir(self, rel: str) -> None:
        """Remove the directory `rel` and everything below it (the marker first, so a
        reader never takes a half-removed directory for a complete one)."""
        if not self.remote:
            shutil.rmtree(self._local(rel), ignore_errors=True)
            return
        self._delete(f"{self._path(rel)}/{MARKER}")
        with suppress(FileNotFoundError):
            self.fs.delete_dir(self._path(rel))

    def rel_of(self, location: str) -> str | None:
        """`location` (a path or URI a record holds) relative to this storage, or None
        when it lies elsewhere. Parsed, not opened."""
        if is_remote(location) != self.remote:
            return None
        if not self.remote:
            text = urlsplit(location).path if location.startswith("file:") else location
            try:
                return Path(text).expanduser().resolve().relative_to(self.root_path).as_posix()
            except ValueError:
                return None
        p, mine = urlsplit(location), self._parts
        host = p.netloc.rpartition("@")[2]
        if (p.scheme, host) != (mine.scheme, mine.netloc.rpartition("@")[2]):
            return None
        full, prefix = f"{host}{p.path}".rstrip("/"), f"{self.root}/"
        return full[len(prefix) :] if full.startswith(prefix) else None

    # -- single files --------------------------------------------------------------------

    @contextmanager
    def writer(self, rel: str) -> Iterator[IO[bytes]]:
        """A binary stream whose bytes replace the file `rel` when the block ends without
        an error; on an error the old file stays as it was."""
        if not self.remote:
            with atomic_file(self._local(rel)) as tmp, tmp.open("wb") as fh:
                yield fh
            return
        target = self._path(rel)
        parent, _, name = target.rpartition("/")
        tmp = f"{parent}/.{name}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            with self.fs.open_output_stream(tmp) as fh:
                yield fh
            self.fs.move(tmp, target)
        except BaseException:
            self._delete(tmp)
            raise

    def put_file(self, src: str | os.PathLike[str], rel: str) -> str:
        """Copy the local file `src` to `rel` atomically; its URI."""
        if Path(src).resolve() != self.local_path(rel):
            with open(src, "rb") as fh, self.writer(rel) as out:
                shutil.copyfileobj(fh, out, 1 << 23)
        return self.uri(rel)

    def get_file(self, rel: str, dest: str | os.PathLike[str]) -> bool:
        """Copy the file `rel` to the local `dest` atomically; False when there is none."""
        if self.local_path(rel) == Path(dest).resolve():
            return Path(dest).is_file()
        data = self.read_bytes(rel)
        if data is None:
            return False
        with atomic_file(dest) as tmp:
            tmp.write_bytes(data)
        return True

    def read_bytes(self, rel: str) -> bytes | None:
        """The bytes of the small file `rel`, or None when there is none."""
        if not self.remote:
            path = self._local(rel)
            return path.read_bytes() if path.is_file() else None
        return self._read(self._path(rel))

    def write_bytes(self, rel: str, data: bytes) -> str:
        with self.writer(rel) as fh:
            fh.write(data)
        return self.uri(rel)

    def delete(self, rel: str) -> None:
        """Remove the file `rel`; nothing when there is none."""
        if not self.remote:
            self._local(rel).unlink(missing_ok=True)
            return
        self._delete(self._path(rel))

    # -- the remote filesystem -----------------------------------------------------------

    def _read(self, path: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(path) as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def _write(self, path: str, data: bytes | IO[bytes]) -> None:
        with self.fs.open_output_stream(path) as out:
            if isinstance(data, bytes):
                out.write(data)
            else:
                shutil.copyfileobj(data, out, 1 << 23)

    def _delete(self, path: str) -> None:
        with suppress(FileNotFoundError):
            self.fs.delete_file(path)


def split_location(location: str) -> tuple[Storage, str]:
    """(the storage holding the file at `location`, its name): for a record's file."""
    if not is_remote(location):
        path = Path(urlsplit(location).path if location.startswith("file:") else location)
        return Storage(path.parent), path.name
    p = urlsplit(location)
    parent, _, name = p.path.rstrip("/").rpartition("/")
    return Storage(urlunsplit((p.scheme, p.netloc, parent, p.query, ""))), name


def _join(*parts: str, absolute: bool = False) -> str:
    text = "/".join(s.strip("/") for s in parts if s.strip("/"))
    return "/" + text if absolute else text
