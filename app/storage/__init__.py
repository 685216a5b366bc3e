"""Where bytes go (a local directory or an S3 prefix) and the checkpoints written there."""

from __future__ import annotations

import os

from app.storage.local import LocalStore
from app.storage.s3 import S3Store
from app.storage.store import StorageUnavailable, Store

__all__ = ["LocalStore", "S3Store", "StorageUnavailable", "Store", "open_store"]


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
