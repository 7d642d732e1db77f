"""The job's storage (`pipeline.storage.store`) on a local directory, a file:// URI and a real
S3-compatible server (moto on 127.0.0.1): directories, whole files, locations, the marker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.storage.store import MARKER, Storage, redact

BUCKET = "lorp"


def make_tree(root: Path, tag: str) -> dict[str, bytes]:
    files = {"config.json": b'{"a": 1}', "model.safetensors": tag.encode() * 1000}
    files["sub/deep.txt"] = f"deep {tag}".encode()
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_put_and_get_a_directory(store: Storage, tmp_path: Path) -> None:
    files = make_tree(tmp_path / "src", "one")
    uri = store.put_dir(tmp_path / "src", "checkpoints/m/a")
    assert uri == store.uri("checkpoints/m/a") and store.complete("checkpoints/m/a")
    assert store.list("checkpoints/m") == ["a"] and store.list("nothing") == []
    assert read_tree(store.get_dir("checkpoints/m/a", tmp_path / "back")) == files
    with store.fetched("checkpoints/m/a") as local:
        assert read_tree(local) == files  # a local copy, or the directory itself
    # A rewrite replaces the directory whole: no file of the old one is left.
    (tmp_path / "src" / "sub" / "deep.txt").unlink()
    store.put_dir(tmp_path / "src", "checkpoints/m/a")
    again = read_tree(store.get_dir("checkpoints/m/a", tmp_path / "back"))
    assert again == {k: v for k, v in files.items() if k != "sub/deep.txt"}


def test_single_files_are_replaced_whole(store: Storage, tmp_path: Path) -> None:
    assert store.read_bytes("catalog.parquet") is None
    assert not store.get_file("catalog.parquet", tmp_path / "x")
    store.write_bytes("catalog.parquet", b"old")
    with pytest.raises(RuntimeError), store.writer("catalog.parquet") as fh:
        fh.write(b"half of the new")
        raise RuntimeError("the writer dies")
    assert store.read_bytes("catalog.parquet") == b"old"  # untouched by the failed write
    (tmp_path / "new").write_bytes(b"new")
    store.put_file(tmp_path / "new", "catalog.parquet")
    assert store.get_file("catalog.parquet", tmp_path / "got")
    assert (tmp_path / "got").read_bytes() == b"new"
    assert store.list() == ["catalog.parquet"]  # no temporary left behind


def test_locations_for_records_and_workers(s3: str, tmp_path: Path) -> None:
    local = Storage(tmp_path / "a" / ".." / "b")
    assert local.uri("x/y") == str((tmp_path / "b" / "x" / "y").resolve())
    assert local.location == str((tmp_path / "b").resolve())
    assert Storage((tmp_path / "b").as_uri()).uri("x") == local.uri("x")
    remote = Storage(s3.format(prefix="p").replace("s3://", "s3://testing:testing@"))
    uri = remote.uri("checkpoints/m")
    assert uri.startswith(f"s3://{BUCKET}/p/checkpoints/m?endpoint_override=")
    assert "testing" not in uri  # records carry no credentials
    assert "testing:testing@" in remote.location  # workers get every parameter
    assert remote.mlflow_uri("mlartifacts") == f"s3://{BUCKET}/p/mlartifacts"
    assert remote.sub("stats").uri("k.npz") == remote.uri("stats/k.npz")
    assert Storage(uri).uri() == uri


def test_no_record_or_message_shows_a_credential(s3: str) -> None:
    """Credentials in a location (`user:secret@`, or a parameter such as Azure's
    `sas_token=` or `account_key=`) never reach a record or an error message; every other
    parameter stays as written."""
    uri = "abfs://me:hunter2@box/p?account_key=k3y&sas_token=sv%3Dx&enable_tls=false&x=1"
    assert redact(uri) == "abfs://box/p?enable_tls=false&x=1"
    assert redact("/a/local/path?x") == "/a/local/path?x"
    located = Storage(s3.format(prefix="p").replace("s3://", "s3://testing:testing@"))
    assert located.uri().endswith("&scheme=http&region=us-east-1")  # nothing else dropped
    # A location pyarrow refuses: the message names it, without its secrets.
    bad = s3.format(prefix="p").replace("s3://", "s3://who:hunter2@") + "&secret_key=s3cr3t"
    with pytest.raises(ValueError) as refused:
        Storage(bad)
    said = str(refused.value)
    assert said.startswith(f"'s3://{BUCKET}/p?endpoint_override=") and "cannot be opened" in said
    assert "hunter2" not in said and "s3cr3t" not in said and "secret_key" in said, said
    # pyarrow quotes a URI it cannot parse: its credentials are masked there too.
    with pytest.raises(ValueError) as refused:
        Storage("s3://who:hunter2@lor p/p")
    said = str(refused.value)
    assert "hunter2" not in said and "'s3://***@lor p/p'" in said, said


class Recording(Storage):
    """Records every object written, in order; `fail_at` makes the n-th write fail, as a
    node dying mid-upload would."""

    def __init__(self, location: str, fail_at: int | None = None) -> None:
        super().__init__(location)
        self.written: list[str] = []
        self.fail_at = fail_at

    def _write(self, path: str, data: Any) -> None:
        if self.fail_at is not None and len(self.written) == self.fail_at:
            raise OSError("the node died mid-upload")
        super()._write(path, data)
        self.written.append(path.rsplit("/", 1)[1])


def test_the_marker_is_written_last_and_guards_readers(s3: str, tmp_path: Path) -> None:
    files = make_tree(tmp_path / "src", "x")
    uri = s3.format(prefix=f"marker/{tmp_path.name}")
    rec = Recording(uri)
    rec.put_dir(tmp_path / "src", "ckpt")
    assert rec.written[-1] == MARKER and sorted(rec.written[:-1]) == sorted(
        n.rsplit("/", 1)[-1] for n in files
    )
    # A rewrite that dies midway: the old marker went first, so readers see nothing.
    dying = Recording(uri, fail_at=1)
    with pytest.raises(OSError, match="mid-upload"):
        dying.put_dir(tmp_path / "src", "ckpt")
    store = Storage(uri)
    assert dying.written and not store.complete("ckpt")
    assert store.list() == []  # ignored by listings
    with pytest.raises(FileNotFoundError, match=MARKER):
        store.get_dir("ckpt", tmp_path / "never")
    assert not (tmp_path / "never").exists()
    # Files written without any marker (a writer still at work) are not a directory yet.
    with store.writer("other/model.safetensors") as fh:
        fh.write(b"partial")
    assert not store.complete("other") and store.list() == []
    store.put_dir(tmp_path / "src", "ckpt")
    assert store.list() == ["ckpt"]
