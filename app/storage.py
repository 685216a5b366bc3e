"""Where bytes go: a local directory or an S3 prefix, behind one small `Store` interface.

Keys are '/'-separated paths relative to the store's root. Every local write is atomic (temp file in the
same directory, fsync, rename, fsync the directory), so a crash never leaves a half-written file under its
final name. A whole folder commits through `staging()` + `commit_dir()`: locally one directory rename,
on S3 one object per file with a chosen file (the manifest) uploaded last.

S3 credentials come only from boto3's standard chain (environment, ~/.aws, instance role); they are
never passed through our config, and `redact` keeps them out of every message we produce. S3 errors
that mean "the store cannot be used" (endpoint unreachable, bucket missing, access denied, no
credentials) become `StorageUnavailable` with a short reason, so callers can report them cleanly.
"""

from __future__ import annotations

import os
import re
import secrets
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
_CHUNK = 8 << 20


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


# ---------------------------------------------------------------- local directory

def fsync_dir(path: Path) -> None:
    """Makes a rename or unlink inside `path` durable (the directory entry itself must hit the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def temp_sibling(path: Path, tag: str = "") -> Path:
    return path.with_name(f"{TEMP_PREFIX}{tag}{path.name}-{secrets.token_hex(4)}")


def atomic_write(path: Path, write) -> None:
    """Calls write(f) on a temp file beside `path`, then fsyncs and renames it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class LocalStore(Store):
    """A directory on a local or shared file system (created on first write)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key).rstrip("/")

    def put_bytes(self, key: str, data: bytes) -> None:
        atomic_write(self._path(key), lambda f: f.write(data))

    def put_file(self, key: str, local_path: str | os.PathLike) -> None:
        with open(local_path, "rb") as src:
            atomic_write(self._path(key), lambda f: shutil.copyfileobj(src, f, _CHUNK))

    def get_file(self, key: str, local_path: str | os.PathLike) -> None:
        with open(self._path(key), "rb") as src:
            atomic_write(Path(local_path), lambda f: shutil.copyfileobj(src, f, _CHUNK))

    def open_read(self, key: str) -> BinaryIO:
        return open(self._path(key), "rb")

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def list(self, prefix: str = "") -> list[str]:
        check_key(prefix, allow_empty=True)
        # walk only the deepest directory the prefix pins down, not the whole tree
        start = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        keys = []
        for dirpath, _, filenames in os.walk(start):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        folder = self.root / prefix.rstrip("/")
        if prefix.endswith("/") and folder.is_dir():
            # rename first so a reader never sees a half-deleted folder under its real name
            doomed = temp_sibling(folder, "deleting-")
            os.rename(folder, doomed)
            fsync_dir(folder.parent)
            shutil.rmtree(doomed, ignore_errors=True)
            return len(keys)
        for key in keys:  # single files; empty directories stay (keys are files, listings never show them)
            self._path(key).unlink(missing_ok=True)
        return len(keys)

    def uri(self, key: str = "") -> str:
        return str(self._path(key)) if key else str(self.root)

    @contextmanager
    def staging(self, folder: str) -> Iterator[Path]:
        # beside the final folder: same file system, so the commit is one atomic rename
        staged = temp_sibling(self._path(folder))
        staged.mkdir(parents=True)
        try:
            yield staged
        finally:
            if staged.exists():
                shutil.rmtree(staged, ignore_errors=True)

    def commit_dir(self, staged: Path, folder: str, last: str) -> None:
        final = self._path(folder)
        if staged.parent != final.parent:
            raise ValueError(f"{staged} is not a staging directory of {final}")
        if not (staged / last).is_file():
            raise ValueError(f"{staged} has no {last}: write it before committing")
        for path in staged.rglob("*"):
            if path.is_file():
                fsync_file(path)
        fsync_dir(staged)
        # a retry of the same step: the old folder steps aside (to a temp name readers skip) just before
        old = temp_sibling(final, "replaced-") if final.exists() else None
        if old:
            os.rename(final, old)
        os.rename(staged, final)
        fsync_dir(final.parent)
        if old:
            shutil.rmtree(old, ignore_errors=True)

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = temp_sibling(self.root / "probe")
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StorageUnavailable(self.describe(), "directory not writable", str(e)) from None


# ---------------------------------------------------------------- S3

def parse_s3_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket/some/prefix/' -> ('bucket', 'some/prefix')."""
    if not uri.startswith("s3://") or len(uri) <= 5 or uri[5] == "/":
        raise ValueError(f"{uri!r} is not an s3://bucket/prefix URI")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.strip("/")


def without_userinfo(url: str | None) -> str | None:
    """An endpoint URL minus any user:password@ part (which must never reach a log). Plain string work:
    a secret with an unescaped '/' would confuse urllib's parser."""
    if not url or "@" not in url:
        return url
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rsplit('@', 1)[1]}" if sep else url.rsplit("@", 1)[1]


_ACCESS_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                  "TokenRefreshRequired", "AllAccessDisabled", "InvalidClientTokenId", "403", "Forbidden"}
_KEY_MISSING = {"NoSuchKey", "404", "NotFound"}


class S3Store(Store):
    """An s3://bucket/prefix on AWS or on an S3-compatible server (`endpoint_url`, path-style addressing)."""

    def __init__(self, uri: str, endpoint_url: str | None = None, *, max_attempts: int = 5,
                 connect_timeout: float = 10.0, multipart_threshold: int = 64 << 20,
                 multipart_chunksize: int = 64 << 20):
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.endpoint_url = endpoint_url
        self.max_attempts, self.connect_timeout = max_attempts, connect_timeout
        self.multipart_threshold, self.multipart_chunksize = multipart_threshold, multipart_chunksize
        self._session = self._client = None

    # The client and session hold resolved credentials: rebuilt per process, never pickled (Ray ships stores).
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_session": None, "_client": None}

    @property
    def client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._session = boto3.session.Session()
            options = dict(retries={"max_attempts": self.max_attempts, "mode": "standard"},
                           connect_timeout=self.connect_timeout, read_timeout=120)
            if self.endpoint_url:
                # S3-compatible servers: no per-bucket DNS names, and older ones (Ceph) reject the
                # checksum trailers that newer botocore adds to every upload by default
                options.update(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                               response_checksum_validation="when_required")
            region = self._session.region_name or "us-east-1"
            self._client = self._session.client("s3", endpoint_url=self.endpoint_url, region_name=region,
                                                config=Config(**options))
        return self._client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _relative(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1:] if self.prefix else full_key

    def _secrets(self) -> list[str | None]:
        creds = self._session.get_credentials() if self._session is not None else None
        return [creds.access_key, creds.secret_key, creds.token] if creds is not None else []

    def _unavailable(self, error: Exception, key: str = "", bucket_request: bool = False) -> Exception:
        """The exception to raise for a botocore error: StorageUnavailable, FileNotFoundError, or the error.
        `bucket_request`: the request named only the bucket, so a bare 404 means the bucket is missing."""
        from botocore import exceptions as bx

        where = self.uri(key) + (f" at {without_userinfo(self.endpoint_url)}" if self.endpoint_url else "")
        detail = redact(f"{type(error).__name__}: {error}", self._secrets())
        if isinstance(error, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError,
                              bx.ConnectionClosedError)):
            return StorageUnavailable(where, "endpoint unreachable", detail)
        if isinstance(error, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            return StorageUnavailable(where, "no AWS credentials (set AWS_* variables, ~/.aws, or an instance role)")
        if isinstance(error, bx.ClientError):
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code == "NoSuchBucket" or (bucket_request and code in _KEY_MISSING):
                return StorageUnavailable(where, f"bucket {self.bucket!r} missing", detail)
            if code in _ACCESS_DENIED:
                return StorageUnavailable(where, "access denied", detail)
            if code in _KEY_MISSING:
                return FileNotFoundError(f"{where}: no such object")
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status >= 500:
                return StorageUnavailable(where, f"server error {status}", detail)
        if isinstance(error, bx.BotoCoreError):
            return StorageUnavailable(where, "S3 request failed", detail)
        return error

    @contextmanager
    def _errors(self, key: str = "", bucket_request: bool = False) -> Iterator[None]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (BotoCoreError, ClientError) as e:
            # `from None`: the original exception's text may carry credentials or signed headers
            raise self._unavailable(e, key, bucket_request) from None

    def _transfer_config(self):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.multipart_threshold, multipart_chunksize=self.multipart_chunksize)

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors(key):
            self.client.put_object(Bucket=self.bucket, Key=self._key(check_key(key)), Body=data)

    def put_file(self, key: str, local_path: str | os.PathLike) -> None:
        with self._errors(key):
            self.client.upload_file(str(local_path), self.bucket, self._key(check_key(key)),
                                    Config=self._transfer_config())

    def get_file(self, key: str, local_path: str | os.PathLike) -> None:
        target = Path(local_path)
        tmp = temp_sibling(target)
        try:
            with self._errors(key):
                self.client.download_file(self.bucket, self._key(check_key(key)), str(tmp),
                                          Config=self._transfer_config())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    def open_read(self, key: str) -> BinaryIO:
        with self._errors(key):
            return self.client.get_object(Bucket=self.bucket, Key=self._key(check_key(key)))["Body"]

    def exists(self, key: str) -> bool:
        try:
            with self._errors(key):
                self.client.head_object(Bucket=self.bucket, Key=self._key(check_key(key)))
            return True
        except FileNotFoundError:
            return False

    def list(self, prefix: str = "") -> list[str]:
        check_key(prefix, allow_empty=True)
        keys = []
        with self._errors(prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
            for page in pages:
                keys.extend(self._relative(obj["Key"]) for obj in page.get("Contents", []))
        return sorted(keys)

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        with self._errors(prefix):
            for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
                batch = [{"Key": self._key(k)} for k in keys[start:start + 1000]]
                result = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
                if result.get("Errors"):
                    first = result["Errors"][0]
                    raise StorageUnavailable(self.uri(prefix), f"delete failed: {first.get('Code')} on {first.get('Key')}")
        return len(keys)

    def describe(self) -> str:
        endpoint = without_userinfo(self.endpoint_url)
        return self.uri() + (f" (endpoint {endpoint})" if endpoint else "")

    def uri(self, key: str = "") -> str:
        base = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"{base}/{key}" if key else base

    def commit_dir(self, staged: Path, folder: str, last: str) -> None:
        prefix = check_key(folder).rstrip("/") + "/"
        # an earlier attempt at this folder: drop its `last` (the manifest) first, so while its other
        # objects are replaced the folder reads as incomplete, never as a mix of two attempts
        self.delete_prefix(prefix + last)
        self.delete_prefix(prefix)
        files = sorted(p for p in staged.rglob("*") if p.is_file())
        for path in files:
            if path.name != last:
                self.put_file(prefix + path.relative_to(staged).as_posix(), path)
        self.put_file(prefix + last, staged / last)

    def check(self) -> None:
        with self._errors(bucket_request=True):
            self.client.head_bucket(Bucket=self.bucket)

    def ensure_bucket(self) -> None:
        """Creates the bucket if it is missing: never done implicitly, so a typo cannot create a bucket."""
        try:
            self.check()
        except StorageUnavailable as e:
            if "missing" not in e.reason:
                raise
            region = self.client.meta.region_name
            extra = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
            with self._errors(bucket_request=True):
                self.client.create_bucket(Bucket=self.bucket, **extra)


def open_store(path_or_uri: str | os.PathLike | Store, endpoint_url: str | None = None) -> Store:
    """A Store for 's3://bucket/prefix' or a local directory path; a Store is returned as it is."""
    if isinstance(path_or_uri, Store):
        return path_or_uri
    text = os.fspath(path_or_uri)
    if text.startswith("s3://"):
        return S3Store(text, endpoint_url=endpoint_url)
    if "://" in text:
        raise ValueError(f"{text!r}: only local paths and s3:// URIs are supported")
    return LocalStore(text)
