"""An S3 prefix as a Store (AWS or an S3-compatible server): a folder commits with its manifest uploaded last."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import boto3
from boto3.s3.transfer import TransferConfig
from botocore import exceptions as bx
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from app.storage.local import temp_sibling
from app.storage.store import StorageUnavailable, Store, check_key, redact


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


_ACCESS_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
    "InvalidClientTokenId",
    "403",
    "Forbidden",
}
_KEY_MISSING = {"NoSuchKey", "404", "NotFound"}


class S3Store(Store):
    """An s3://bucket/prefix on AWS or on an S3-compatible server (`endpoint_url`, path-style addressing)."""

    def __init__(
        self,
        uri: str,
        endpoint_url: str | None = None,
        *,
        max_attempts: int = 5,
        connect_timeout: float = 10.0,
        multipart_threshold: int = 64 << 20,
        multipart_chunksize: int = 64 << 20,
    ):
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
            self._session = boto3.session.Session()
            options = dict(
                retries={"max_attempts": self.max_attempts, "mode": "standard"},
                connect_timeout=self.connect_timeout,
                read_timeout=120,
            )
            if self.endpoint_url:
                # S3-compatible servers: no per-bucket DNS names, and older ones (Ceph) reject the
                # checksum trailers that newer botocore adds to every upload by default
                options.update(
                    s3={"addressing_style": "path"},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
            region = self._session.region_name or "us-east-1"
            self._client = self._session.client(
                "s3", endpoint_url=self.endpoint_url, region_name=region, config=Config(**options)
            )
        return self._client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _relative(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1 :] if self.prefix else full_key

    def _secrets(self) -> list[str | None]:
        creds = self._session.get_credentials() if self._session is not None else None
        return [creds.access_key, creds.secret_key, creds.token] if creds is not None else []

    def _unavailable(self, error: Exception, key: str = "", bucket_request: bool = False) -> Exception:
        """The exception to raise for a botocore error: StorageUnavailable, FileNotFoundError, or the error.
        `bucket_request`: the request named only the bucket, so a bare 404 means the bucket is missing."""

        where = self.uri(key) + (f" at {without_userinfo(self.endpoint_url)}" if self.endpoint_url else "")
        detail = redact(f"{type(error).__name__}: {error}", self._secrets())
        if isinstance(
            error, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError, bx.ConnectionClosedError)
        ):
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

        try:
            yield
        except (BotoCoreError, ClientError) as e:
            # `from None`: the original exception's text may carry credentials or signed headers
            raise self._unavailable(e, key, bucket_request) from None

    def _transfer_config(self):

        return TransferConfig(
            multipart_threshold=self.multipart_threshold, multipart_chunksize=self.multipart_chunksize
        )

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors(key):
            self.client.put_object(Bucket=self.bucket, Key=self._key(check_key(key)), Body=data)

    def put_file(self, key: str, local_path: str | os.PathLike) -> None:
        with self._errors(key):
            self.client.upload_file(
                str(local_path), self.bucket, self._key(check_key(key)), Config=self._transfer_config()
            )

    def get_file(self, key: str, local_path: str | os.PathLike) -> None:
        target = Path(local_path)
        tmp = temp_sibling(target)
        try:
            with self._errors(key):
                self.client.download_file(
                    self.bucket, self._key(check_key(key)), str(tmp), Config=self._transfer_config()
                )
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
                batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
                result = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
                if result.get("Errors"):
                    first = result["Errors"][0]
                    raise StorageUnavailable(
                        self.uri(prefix), f"delete failed: {first.get('Code')} on {first.get('Key')}"
                    )
        return len(keys)

    def describe(self) -> str:
        endpoint = without_userinfo(self.endpoint_url)
        return self.uri() + (f" (endpoint {endpoint})" if endpoint else "")

    def uri(self, key: str = "") -> str:
        base = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"{base}/{key}" if key else base

    def commit_dir(self, staged: Path, folder: str, last: str) -> None:
        prefix = check_key(folder).rstrip("/") + "/"
        # an earlier, interrupted write of this folder: drop its `last` (the manifest) first, so while its other
        # objects are replaced the folder reads as incomplete, never as a mix of two writes
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
