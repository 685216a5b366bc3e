"""Full training checkpoints: staged, committed atomically, resumed from the newest complete one.

Layout under a checkpoint root (a local directory or an S3 prefix, see app.storage.store):

    global_step_000020/
        adapter_model.safetensors, adapter_config.json   a PEFT adapter folder (PeftModel.from_pretrained)
        optimizer.safetensors, rng.safetensors           flat tensor dicts, keys chosen by the caller
        state.json                                       step + the caller's JSON state
        MANIFEST.json                                    written last: size and sha256 of every other file
    latest                                               the folder name, rewritten after the folder commits

The `latest` marker is the commit point: resume follows it when it names a complete folder and scans the
folders newest first when it does not. A folder is complete when its manifest parses and every file
matches it; anything else (an interrupted write, a flipped byte, a truncated file) is skipped with a
warning that names the folder and the problem. Nothing is ever unpickled: tensors are safetensors,
everything else JSON (DESIGN.md rule 6). One writer per root is assumed: a save deletes the leftovers
of interrupted writes, which would break a second writer's write in progress.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors.torch import load_file

from app.model.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, normalize_keys
from app.storage import open_store
from app.storage.safetensors_stream import stream_save_safetensors
from app.storage.store import TEMP_PREFIX, Store

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST, STATE, OPTIMIZER, RNG, LATEST = (
    "MANIFEST.json",
    "state.json",
    "optimizer.safetensors",
    "rng.safetensors",
    "latest",
)
FULL_FILES = (ADAPTER_WEIGHTS, ADAPTER_CONFIG, OPTIMIZER, RNG, STATE)
_FOLDER = re.compile(r"^global_step_(\d+)$")
_CHUNK = 8 << 20


class CheckpointCorrupt(RuntimeError):
    """A checkpoint folder that is incomplete or does not match its manifest; the message says how."""


@dataclass
class TrainingState:
    """Everything a resumed run needs. `state` must be plain JSON (tuples come back as lists)."""

    step: int
    adapter: dict[str, torch.Tensor]
    adapter_config: dict
    optimizer: dict[str, torch.Tensor] = field(default_factory=dict)
    rng_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointInfo:
    name: str  # the folder name, e.g. global_step_000020
    step: int
    location: str  # a path or s3:// URI of the folder
    kind: str = "checkpoint"  # or "adapter" for export_adapter folders


def folder_name(step: int) -> str:
    return f"global_step_{step:06d}"


# ---------------------------------------------------------------- writing


def _write_json(path: Path, obj, what: str, indent: int | None = None) -> None:
    try:
        text = json.dumps(obj, indent=indent)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be plain JSON (dict, list, str, number, bool, None): {e}") from None
    path.write_text(text)


def _write_adapter(folder: Path, adapter: Mapping[str, torch.Tensor], adapter_config: dict) -> None:
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in adapter_config]
    if missing:
        raise ValueError(f"adapter_config lacks {missing}: pass AdapterSpec.peft_config() (app.model.adapters)")
    tensors = normalize_keys(dict(adapter))  # PEFT's saved names, so the folder loads in PEFT and vLLM
    not_float = [k for k, t in tensors.items() if not t.is_floating_point()]
    if not_float:
        raise ValueError(f"adapter tensor {not_float[0]} is not floating point")
    stream_save_safetensors(folder / ADAPTER_WEIGHTS, tensors, metadata={"format": "pt"})
    _write_json(folder / ADAPTER_CONFIG, adapter_config, "adapter_config", indent=2)


def _digest(stream: BinaryIO) -> tuple[int, str]:
    sha, size = hashlib.sha256(), 0
    while chunk := stream.read(_CHUNK):
        sha.update(chunk)
        size += len(chunk)
    return size, sha.hexdigest()


def _write_manifest(folder: Path, step: int, kind: str) -> None:
    files = {}
    for path in sorted(folder.iterdir()):
        with open(path, "rb") as f:
            size, sha = _digest(f)
        files[path.name] = {"sha256": sha, "bytes": size}
    _write_json(folder / MANIFEST, {"format": FORMAT, "step": step, "kind": kind, "files": files}, "manifest", 2)


def _commit(store: Store, name: str, step: int, kind: str, write_files: Callable[[Path], None]) -> None:
    """Stages the folder, writes its manifest, commits it (manifest last), then moves the marker to it."""
    with store.staging(name) as staged:
        write_files(staged)
        _write_manifest(staged, step, kind)
        store.commit_dir(staged, name, last=MANIFEST)
    store.put_bytes(LATEST, name.encode())


def save_checkpoint(store_or_root: Store | str, ts: TrainingState, keep_last: int | None = None) -> str:
    """Writes `ts` as global_step_{step}/ and moves `latest` to it; returns the folder name.
    With keep_last, older complete checkpoints beyond the newest keep_last are deleted afterwards."""
    store = open_store(store_or_root)
    name = folder_name(ts.step)
    remove_leftovers(store)

    def write_files(staged: Path) -> None:
        _write_adapter(staged, ts.adapter, ts.adapter_config)
        stream_save_safetensors(staged / OPTIMIZER, ts.optimizer)
        stream_save_safetensors(staged / RNG, ts.rng_tensors)
        _write_json(staged / STATE, {"step": ts.step, "state": ts.state}, "TrainingState.state")

    _commit(store, name, ts.step, "checkpoint", write_files)
    log.info("checkpoint %s committed at %s", name, store.uri(name))
    if keep_last is not None:
        prune(store, keep_last, current=name)
    return name


def export_adapter(
    store_or_root: Store | str, step: int, adapter: Mapping[str, torch.Tensor], adapter_config: dict
) -> str:
    """Writes global_step_{step}/ with only the PEFT adapter files (+ manifest), atomically; moves `latest`."""
    store = open_store(store_or_root)
    name = folder_name(step)
    remove_leftovers(store)
    _commit(store, name, step, "adapter", lambda staged: _write_adapter(staged, adapter, adapter_config))
    log.info("adapter %s exported to %s", name, store.uri(name))
    return name


def _folders(store: Store) -> dict[str, set[str]]:
    """Top-level entries of the root -> the keys below each (files at the top level map to an empty set)."""
    entries: dict[str, set[str]] = {}
    for key in store.list(""):
        top, _, rest = key.partition("/")
        entries.setdefault(top, set()).update([rest] if rest else [])
    return entries


def _step(name: str) -> int:
    return int(_FOLDER.match(name).group(1))


def remove_leftovers(store: Store) -> None:
    """Deletes what interrupted writes left: temp folders/files, and step folders that never got a manifest."""
    for top, files in _folders(store).items():
        if top.startswith(TEMP_PREFIX) or (_FOLDER.match(top) and MANIFEST not in files):
            log.info("removing %s, left by an interrupted write", store.uri(top))
            store.delete_prefix(f"{top}/" if files else top)


def prune(store: Store, keep_last: int, current: str) -> None:
    """Keeps the newest keep_last complete checkpoints up to `current` (always kept). Newer folders (left
    from before a resume from an older checkpoint) are not touched."""
    limit = _step(current)
    complete = sorted(
        (n for n, files in _folders(store).items() if _FOLDER.match(n) and MANIFEST in files and _step(n) <= limit),
        key=_step,
    )
    for name in complete[:-keep_last] if keep_last > 0 else complete:
        if name != current:
            # manifest first: a half-deleted folder then reads as incomplete, never as corrupt
            store.delete_prefix(f"{name}/{MANIFEST}")
            store.delete_prefix(f"{name}/")
            log.info("pruned checkpoint %s (keep_last=%d)", name, keep_last)


# ---------------------------------------------------------------- reading


def read_manifest(store: Store, name: str) -> dict:
    try:
        raw = store.get_bytes(f"{name}/{MANIFEST}")
    except FileNotFoundError:
        raise CheckpointCorrupt(f"incomplete: no {MANIFEST} (its write was interrupted before the commit)") from None
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        ok = (
            manifest["format"] == FORMAT
            and manifest["step"] == _step(name)
            and isinstance(files, dict)
            and all(
                "/" not in f
                and f not in ("", ".", "..")
                and isinstance(e["bytes"], int)
                and isinstance(e["sha256"], str)
                for f, e in files.items()
            )
        )
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointCorrupt(f"unparsable {MANIFEST} (not format {FORMAT} JSON for step {_step(name)})")
    return manifest


def check_files(manifest: dict, open_file: Callable[[str], BinaryIO]) -> None:
    for fname, expected in sorted(manifest["files"].items()):
        try:
            with open_file(fname) as f:
                size, sha = _digest(f)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{fname} is missing") from None
        if size != expected["bytes"]:
            raise CheckpointCorrupt(f"{fname} has {size} bytes, the manifest says {expected['bytes']} (truncated?)")
        if sha != expected["sha256"]:
            raise CheckpointCorrupt(
                f"checksum mismatch in {fname}: sha256 {sha[:12]}…, manifest {expected['sha256'][:12]}…"
            )


def _candidates(store: Store) -> list[str]:
    """Step folders to try, best first: the one the `latest` marker names, then all others newest first."""
    folders = _folders(store)
    for top in folders:
        if top.startswith(TEMP_PREFIX):
            log.warning("ignoring %s: an unfinished write (temp entry)", store.uri(top))
    order = sorted((n for n in folders if _FOLDER.match(n)), key=_step, reverse=True)
    marker = store.get_bytes(LATEST).decode(errors="replace").strip() if LATEST in folders else None
    if marker in order:
        for name in order[: order.index(marker)]:
            log.warning(
                "ignoring %s: newer than %s, which the %s marker names (a write that was not committed, "
                "or one from before a resume from an older checkpoint)",
                store.uri(name),
                marker,
                LATEST,
            )
        order.insert(0, order.pop(order.index(marker)))
    elif marker is not None:
        log.warning("the %s marker names %r, which is not a checkpoint folder here; scanning instead", LATEST, marker)
    return order


def find_latest(store_or_root: Store | str) -> CheckpointInfo | None:
    """The newest complete checkpoint (every file checked against the manifest), or None."""
    store = open_store(store_or_root)
    for name in _candidates(store):
        try:
            manifest = read_manifest(store, name)
            check_files(manifest, lambda fname: store.open_read(f"{name}/{fname}"))
        except CheckpointCorrupt as e:
            log.warning("skipping checkpoint %s: %s", store.uri(name), e)
            continue
        return CheckpointInfo(name, manifest["step"], store.uri(name), manifest.get("kind", "checkpoint"))
    return None


def resumed_adapter_config(store: Store, name: str | None = None) -> tuple[str, dict] | None:
    """(folder, adapter_config.json) of the checkpoint a resume would load (`name`, else the newest whose manifest
    and adapter config check out), read without the adapter or optimizer: what a run checks before it starts."""
    for folder in [name] if name else _candidates(store):
        try:
            entry = read_manifest(store, folder)["files"].get(ADAPTER_CONFIG)
            raw = store.get_bytes(f"{folder}/{ADAPTER_CONFIG}")
            if entry and entry["sha256"] == hashlib.sha256(raw).hexdigest():
                return folder, json.loads(raw)
        except (CheckpointCorrupt, FileNotFoundError, ValueError):
            pass  # skipped here as the resume skips it
    return None


@contextmanager
def local_copies(store: Store, name: str, fnames: Iterable[str]) -> Iterator[dict[str, Path]]:
    """The folder's files on this machine: in place for a local store, else downloaded to a temp dir."""
    if store.local_path(name) is not None:
        yield {f: store.local_path(f"{name}/{f}") for f in fnames}
        return
    with store.staging(name) as tmp:
        paths = {}
        for fname in fnames:
            try:
                store.get_file(f"{name}/{fname}", tmp / fname)
            except FileNotFoundError:
                pass  # reported by check_files, like a missing local file
            paths[fname] = tmp / fname
        yield paths


def _load(store: Store, name: str) -> TrainingState:

    manifest = read_manifest(store, name)
    missing = [f for f in FULL_FILES if f not in manifest["files"]]
    if missing:
        kind = manifest.get("kind", "?")
        raise CheckpointCorrupt(f"not a full training checkpoint (kind {kind!r}; lacks {', '.join(missing)})")
    with local_copies(store, name, manifest["files"]) as paths:
        check_files(manifest, lambda fname: open(paths[fname], "rb"))  # the very bytes that get loaded
        try:
            state = json.loads(paths[STATE].read_text())
            if state["step"] != manifest["step"]:
                raise ValueError(f"{STATE} says step {state['step']}, the manifest {manifest['step']}")
            return TrainingState(
                step=manifest["step"],
                adapter=load_file(str(paths[ADAPTER_WEIGHTS])),
                adapter_config=json.loads(paths[ADAPTER_CONFIG].read_text()),
                optimizer=load_file(str(paths[OPTIMIZER])),
                rng_tensors=load_file(str(paths[RNG])),
                state=state["state"],
            )
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise CheckpointCorrupt(f"unreadable despite matching checksums: {e}") from None


def _load_newest(store: Store) -> tuple[str, TrainingState] | None:
    for name in _candidates(store):
        try:
            return name, _load(store, name)
        except CheckpointCorrupt as e:
            log.warning("skipping checkpoint %s: %s", store.uri(name), e)
    return None


def load_checkpoint(store_or_root: Store | str, name: str | None = None) -> TrainingState:
    """The checkpoint `name` (default: the newest complete one), verified against its manifest first.
    Raises CheckpointCorrupt for a bad named folder, FileNotFoundError when there is no complete one."""
    store = open_store(store_or_root)
    if name is not None:
        try:
            return _load(store, name)
        except CheckpointCorrupt as e:
            raise CheckpointCorrupt(f"checkpoint {store.uri(name)}: {e}") from None
    newest = _load_newest(store)
    if newest is None:
        raise FileNotFoundError(f"no complete checkpoint under {store.describe()}")
    return newest[1]


def resolve_resume(
    mode: str, root: Store | str, path: str | None = None, endpoint_url: str | None = None
) -> TrainingState | None:
    """The state to resume from for checkpoint.resume_mode, logging which checkpoint is used or why none.
    'path' takes a step folder (…/global_step_000020) or a root (its newest complete checkpoint)."""
    if mode == "none":
        log.info("resume_mode is 'none': starting from scratch")
        return None
    if mode == "latest":
        store = open_store(root, endpoint_url)
        newest = _load_newest(store)
        if newest is None:
            log.info("no complete checkpoint under %s: starting from scratch", store.describe())
            return None
        name, ts = newest
    elif mode == "path":
        if not path:
            raise ValueError("resume_mode 'path' needs a checkpoint path")
        parent, _, last = path.rstrip("/").rpartition("/")
        if _FOLDER.match(last):
            store, name = open_store(parent or ".", endpoint_url), last
            ts = load_checkpoint(store, name)
        else:
            store = open_store(path, endpoint_url)
            newest = _load_newest(store)
            if newest is None:  # an explicit path must not silently become a fresh start
                raise FileNotFoundError(f"resume_path {store.describe()} holds no complete checkpoint")
            name, ts = newest
    else:
        raise ValueError(f"resume mode {mode!r} is not one of 'latest', 'none', 'path'")
    log.info("resuming from checkpoint %s (step %d)", store.uri(name), ts.step)
    return ts
