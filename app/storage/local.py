"""A local (or mounted shared) directory as a Store: every write atomic, every commit one rename."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from app.storage.store import TEMP_PREFIX, StorageUnavailable, Store, check_key

_CHUNK = 8 << 20


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
