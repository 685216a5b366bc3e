"""Where bytes go: a local directory or an S3 prefix, behind one small `Store` interface.

Keys are '/'-separated paths relative to the store's root. Every local write is atomic (temp file in the
same directory, fsync, rename, fsync the directory), so a crash never leaves a half-written file under its
final name. A whole folder commits through `staging()` + `commit_dir()`: locally one directory rename,
on S3 one object per file with a chosen file (the manifest) uploaded last.

S3 credentials come only from boto3's standard chain (environment, ~/.aws, instance role); they are
never passed through our config, and `redact` keeps them out of every message we produce. S3 errors
that mean "the store cannot be used" (endpoint unreachable, bucket missing, access denied, no
credentials) become `StorageUnavailable` with a short reason, so callers can report them cleanly.

The two stores: app/storage/local.py and app/storage/s3.py; `app.storage.open_store` picks one.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

TEMP_PREFIX = ".tmp-"  # names of in-flight writes; readers skip them, the next checkpoint save deletes them
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_ACCESS_KEY_PATTERN = re.compile(r"\b(?:AKIA|ASIA|AROA|AIDA)[A-Z0-9]{12,}\b")


class StorageUnavailable(RuntimeError):
    """The store cannot be used right now; `reason` says why in a few words (no credentials in it)."""

    def __init__(self, where: str, reason: str, detail: str = ""):
        self.where, self.reason = where, reason
        super().__init__(redact(f"{where}: {reason}" + (f" ({detail})" if detail else "")))


def redact(text: str, extra_secrets: Iterable[str | None] = ()) -> str:
    """`text` without the AWS credentials of this environment (and `extra_secrets`), nor anything shaped
    like an AWS access key id."""
    values = [os.environ.get(name) for name in _CREDENTIAL_ENV] + list(extra_secrets)
    for value in sorted({v for v in values if v and len(v) >= 4}, key=len, reverse=True):
        text = text.replace(value, "<redacted>")
    return _ACCESS_KEY_PATTERN.sub("<redacted>", text)


def check_key(key: str, allow_empty: bool = False) -> str:
    """A key is a relative '/'-path without '.', '..' or empty segments (a trailing '/' names a folder)."""
    body = key[:-1] if key.endswith("/") else key
    if not body and allow_empty:
        return key
    if not body or key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in body.split("/")):
        raise ValueError(f"invalid storage key {key!r}: use a relative path like 'global_step_000010/state.json'")
    return key


class Store(ABC):
    """Bytes under string keys: `LocalStore` (a directory) or `S3Store` (a prefix). Reads of a missing key
    raise FileNotFoundError; `list` and `delete_prefix` take plain string prefixes ('a/' is a folder)."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def put_file(self, key: str, local_path: str | os.PathLike) -> None: ...

    @abstractmethod
    def get_file(self, key: str, local_path: str | os.PathLike) -> None: ...

    @abstractmethod
    def open_read(self, key: str) -> BinaryIO:
        """A binary stream of the object, to hash or copy large files without holding them."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]: ...

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int: ...

    @abstractmethod
    def uri(self, key: str = "") -> str:
        """A path or s3:// URI naming `key`, for humans and tools; never holds credentials."""

    @abstractmethod
    def commit_dir(self, staged: Path, folder: str, last: str) -> None:
        """Makes the files of `staged` (from `staging`) visible under `folder/`, replacing what was there;
        the file named `last` becomes visible last."""

    def get_bytes(self, key: str) -> bytes:
        with self.open_read(key) as f:
            return f.read()

    def describe(self) -> str:
        """Where this store is, for logs; never holds credentials."""
        return self.uri()

    def local_path(self, key: str) -> Path | None:
        """The key's file on this machine when the store is local (to read it in place), else None."""
        return None

    @contextmanager
    def staging(self, folder: str) -> Iterator[Path]:
        """An empty local directory to assemble `folder` in before `commit_dir`; removed afterwards."""
        staged = Path(tempfile.mkdtemp(prefix=f"mazerl-{Path(folder).name}-"))
        try:
            yield staged
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def check(self) -> None:
        """Raises StorageUnavailable unless the store can be used (call it before a run starts)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"
