"""The serving app's adapters: names, discovery under a root, checked downloads, and the replica's LRU cache.

An adapter is a folder under the adapters root (a local directory or an s3:// prefix) that holds
`adapter_config.json` and `adapter_model.safetensors`; its name is its path below the root, one or two
plain segments: `global_step_000020` (what app.storage.checkpoint.export_adapter writes) or
`<run>/global_step_000020` (a root that holds several runs' export folders). A segment is letters, digits,
'.', '_' and '-', starting with a letter or digit: nothing that could leave the root ('..', '/x',
's3://…', '%2e') is a name. A `global_step_N` folder counts only once its MANIFEST.json is there (the
exporter writes it last), and the files are then checked against it; a plain PEFT folder (no manifest)
is served as it is.

The cache holds adapter TENSORS, already fitted to the engine's LoRA shape (`fit_to_spec`), bounded by
count and evicted least-recently-used. A cached adapter is never read from storage again; the folders
an adapter name points to are immutable once committed, so the cache is never stale in practice (a
re-export of the same step under the same name is served from the cache until it is evicted). An adapter
that carries a trained vision tower (PEFT's modules_to_save [visual], what a run with lora.modules_to_save
[visual] exports) keeps the tower's weights beside its LoRA; app.serve.service swaps the engine's tower with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from collections import OrderedDict

import torch
from safetensors.torch import load as load_safetensors

from app.model import adapters
from app.model.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterMismatch, AdapterSpec
from app.storage.store import Store

MANIFEST = "MANIFEST.json"  # app.storage.checkpoint.MANIFEST (not imported: checkpoint pulls in training-side code)
MAX_NAME_CHARS = 256
MAX_NESTING = 2  # "name" or "run/name"
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_STEP_FOLDER = re.compile(r"global_step_\d+")


class InvalidAdapterName(ValueError):
    """A model name that is not a plain adapter name (HTTP 400)."""


class UnknownAdapter(LookupError):
    """No complete adapter of that name under the root (HTTP 404); `available` lists those there are."""

    def __init__(self, name: str, available: list[str], why: str = "no such adapter"):
        self.name, self.available, self.why = name, available, why
        super().__init__(f"{why}: {name!r}")


class AdapterUnusable(ValueError):
    """The adapter exists but cannot be served: corrupt, or not a fit for the base model (HTTP 422)."""


def check_name(name: object) -> str:
    """`name` when it is a plain adapter name (see the module doc), else InvalidAdapterName."""
    if not isinstance(name, str) or not name:
        raise InvalidAdapterName("the model name must be a non-empty string")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidAdapterName(f"the model name is longer than {MAX_NAME_CHARS} characters")
    segments = name.split("/")
    if len(segments) > MAX_NESTING or not all(_SEGMENT.fullmatch(s) for s in segments):
        raise InvalidAdapterName(
            f"invalid model name {name[:80]!r}: an adapter name is its folder under the adapters root, one or two "
            "segments of letters, digits, '.', '_' or '-' ('global_step_000020' or 'run/global_step_000020')"
        )
    return name


def complete_adapters(keys: list[str]) -> list[str]:
    """The names of the complete adapter folders among a root's keys (sorted)."""
    folders: dict[str, set[str]] = {}
    for key in keys:
        folder, _, file = key.rpartition("/")
        if folder:
            folders.setdefault(folder, set()).add(file)
    names = []
    for folder, files in folders.items():
        if not {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= files:
            continue
        if _STEP_FOLDER.fullmatch(folder.rsplit("/", 1)[-1]) and MANIFEST not in files:
            continue  # an export still being written (its manifest comes last)
        try:
            names.append(check_name(folder))
        except InvalidAdapterName:
            continue  # temp folders of interrupted writes ('.tmp-…'), deeper nesting
    return sorted(names)


def zero_adapter(spec: AdapterSpec, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """An adapter that changes nothing (B = 0): loading it makes an engine serve the base model exactly."""
    return {name: torch.zeros(shape, dtype=dtype) for name, shape in spec.shapes.items()}


def fit_to_spec(tensors: dict[str, torch.Tensor], spec: AdapterSpec, target: AdapterSpec) -> dict[str, torch.Tensor]:
    """The adapter `tensors` (valid for `spec`) as tensors of the engine's LoRA shape `target`, same function.

    An engine holds one LoRA shape (rank, alpha, target modules). An adapter of rank r <= R over a subset of
    the engine's modules is embedded exactly: A padded with zero rows, B with zero columns and rescaled by
    (alpha/r) / (alpha_engine/R), modules it lacks all zeros. Same shape and scale: returned unchanged."""
    same_scale = spec.alpha * target.rank == target.alpha * spec.rank
    if spec.shapes == target.shapes and same_scale:
        return tensors
    missing = sorted(set(spec.target_modules) - set(target.target_modules))
    if missing:
        raise AdapterMismatch(
            f"the adapter has LoRA on {missing}, which this server's engine LoRA does not cover "
            f"({sorted(target.target_modules)}); restart the server with those --lora-targets"
        )
    if spec.rank > target.rank:
        raise AdapterMismatch(
            f"the adapter's rank {spec.rank} exceeds this server's engine LoRA rank {target.rank}; "
            "restart the server with a larger --lora-rank"
        )
    factor = (spec.alpha / spec.rank) / (target.alpha / target.rank)
    dtype = next(iter(tensors.values())).dtype if tensors else torch.float32
    out = {}
    for name, shape in target.shapes.items():
        fitted = torch.zeros(shape, dtype=dtype)
        src = tensors.get(name)
        if src is not None:
            if name.endswith("lora_A.weight"):
                fitted[: spec.rank, :] = src
            else:
                fitted[:, : spec.rank] = src * factor if factor != 1.0 else src
        out[name] = fitted
    return out


def is_whole_model(config: dict) -> bool:
    """An export that trained the language model's every weight: a whole model in adapter form, served only merged."""
    return "language_model" in (config.get("modules_to_save") or [])


def parse_adapter(
    config_bytes: bytes, weight_bytes: bytes, text_config, target: AdapterSpec, vision_config=None
) -> dict[str, torch.Tensor]:
    """Engine-ready tensors from an adapter folder's two files; AdapterUnusable says what is wrong.

    vision_config: the base model's, where the server takes adapters that carry a trained vision tower
    (modules_to_save [visual]); their tower's weights come back beside the fitted LoRA, under PEFT's names."""

    try:
        config = json.loads(config_bytes)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise AdapterUnusable(f"{ADAPTER_CONFIG} is not valid JSON ({e})") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterUnusable(f"peft_type {config.get('peft_type')!r} is not LORA")
    for flag in ("use_dora", "use_rslora"):
        if config.get(flag):
            raise AdapterUnusable(f"{flag} adapters are not served (plain LoRA only)")
    if is_whole_model(config):
        raise AdapterUnusable(
            "the adapter carries the language model's every weight (modules_to_save [language_model]): it is a whole "
            "model, not an adapter to swap; merge it with scripts/merge_adapter.py and serve that folder as the model"
        )
    try:
        spec = adapters.spec_from_peft_config(text_config, config, vision_config)
    except (KeyError, TypeError, ValueError) as e:  # AdapterMismatch is a ValueError
        raise AdapterUnusable(f"{ADAPTER_CONFIG} does not describe a LoRA of this base model ({e})") from None
    try:
        tensors = adapters.normalize_keys(load_safetensors(weight_bytes))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for any bad header
        raise AdapterUnusable(f"{ADAPTER_WEIGHTS} is not a readable safetensors file ({type(e).__name__})") from None
    try:
        adapters.validate(tensors, spec)
        tower = {k: v for k, v in tensors.items() if not adapters.is_lora(k)}
        lora = {k: v for k, v in tensors.items() if adapters.is_lora(k)}
        lora_spec = dataclasses.replace(
            spec, shapes={k: v for k, v in spec.shapes.items() if adapters.is_lora(k)}, modules_to_save=()
        )
        return {**fit_to_spec(lora, lora_spec, target), **tower}
    except AdapterMismatch as e:
        raise AdapterUnusable(str(e)) from None


class AdapterRegistry:
    """Finds adapters under a store's root and keeps the most recently used ones' tensors in memory.

    Thread-safe: the server calls `get` and `available` from worker threads. Two requests for the same
    uncached adapter download it once (the second waits for the first). `stats` counts every storage
    read and listing, per-adapter downloads, hits and evictions (the server exposes it)."""

    def __init__(
        self,
        store: Store | None,
        text_config,
        target: AdapterSpec,
        max_cached: int = 4,
        max_adapter_bytes: int = 4 << 30,
        vision_config=None,
    ):
        """store None: no adapters root (the base model alone is served). vision_config: the base model's, to take
        adapters that carry a trained vision tower (None: refused)."""
        if max_cached < 1:
            raise ValueError(f"max_cached must be >= 1, got {max_cached}")
        self.store, self.text_config, self.target, self.vision_config = store, text_config, target, vision_config
        self.max_cached, self.max_adapter_bytes = max_cached, max_adapter_bytes
        self._cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}
        self._whole_models: dict[str, bool] = {}  # per complete adapter: a whole model (exports never change)
        self._stats = {
            "storage_reads": 0,
            "storage_lists": 0,
            "cache_hits": 0,
            "cache_misses": 0,
            "evictions": 0,
            "downloads": {},
        }

    # ------------------------------------------------------------ discovery
    def available(self) -> list[str]:
        """Complete adapters under the root right now that the engine can swap in (one listing, and each new name's
        config read once: whole-model exports are left out); StorageUnavailable when the root cannot be read."""
        if self.store is None:
            return []
        with self._lock:
            self._stats["storage_lists"] += 1
        names = complete_adapters(self.store.list(""))
        return [name for name in names if not self._whole_model(name)]

    def _whole_model(self, name: str) -> bool:
        with self._lock:
            known = self._whole_models.get(name)
        if known is None:
            try:
                config = json.loads(self._read(f"{name}/{ADAPTER_CONFIG}"))
                known = isinstance(config, dict) and is_whole_model(config)
            except (FileNotFoundError, ValueError):
                return False  # listed, and a request for it says what is wrong with it
            with self._lock:
                self._whole_models[name] = known
        return known

    def cached(self) -> list[str]:
        with self._lock:
            return list(self._cache)

    def stats(self) -> dict:
        with self._lock:
            return {
                **self._stats,
                "downloads": dict(self._stats["downloads"]),
                "cached": list(self._cache),
                "max_cached": self.max_cached,
                "root": self.store.describe() if self.store is not None else None,
            }

    # ------------------------------------------------------------ loading
    def get(self, name: str) -> dict[str, torch.Tensor]:
        """The engine-ready tensors of adapter `name`: from the cache, else downloaded, checked and cached.
        Raises InvalidAdapterName, UnknownAdapter, AdapterUnusable or StorageUnavailable."""
        check_name(name)
        with self._lock:
            hit = self._hit(name)
            if hit is not None:
                return hit
            loading = self._loading.setdefault(name, threading.Lock())
        with loading:
            with self._lock:
                hit = self._hit(name)  # another request loaded it while this one waited
                if hit is not None:
                    return hit
                self._stats["cache_misses"] += 1
            try:
                tensors = self._download(name)
            finally:
                with self._lock:
                    self._loading.pop(name, None)
            with self._lock:
                self._cache[name] = tensors
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
                    self._stats["evictions"] += 1
            return tensors

    def _hit(self, name: str) -> dict[str, torch.Tensor] | None:
        tensors = self._cache.get(name)
        if tensors is not None:
            self._cache.move_to_end(name)
            self._stats["cache_hits"] += 1
        return tensors

    def _read(self, key: str) -> bytes:
        if self.store is None:
            raise FileNotFoundError(key)
        with self._lock:
            self._stats["storage_reads"] += 1
        return self.store.get_bytes(key)

    def _download(self, name: str) -> dict[str, torch.Tensor]:
        manifest = None
        try:
            manifest = self._read(f"{name}/{MANIFEST}")
        except FileNotFoundError:
            if _STEP_FOLDER.fullmatch(name.rsplit("/", 1)[-1]):
                raise self._unknown(name) from None
        try:
            config_bytes = self._read(f"{name}/{ADAPTER_CONFIG}")
            weight_bytes = self._read(f"{name}/{ADAPTER_WEIGHTS}")
        except FileNotFoundError:
            raise self._unknown(name) from None
        if len(weight_bytes) > self.max_adapter_bytes:
            raise AdapterUnusable(
                f"{ADAPTER_WEIGHTS} has {len(weight_bytes)} bytes, over the server's limit of {self.max_adapter_bytes}"
            )
        if manifest is not None:
            _check_manifest(manifest, {ADAPTER_CONFIG: config_bytes, ADAPTER_WEIGHTS: weight_bytes})
        tensors = parse_adapter(config_bytes, weight_bytes, self.text_config, self.target, self.vision_config)
        with self._lock:
            self._stats["downloads"][name] = self._stats["downloads"].get(name, 0) + 1
        return tensors

    def _unknown(self, name: str) -> UnknownAdapter:
        return UnknownAdapter(name, self.available())


def _check_manifest(raw: bytes, files: dict[str, bytes]) -> None:
    try:
        entries = json.loads(raw)["files"]
    except (ValueError, KeyError, TypeError):
        raise AdapterUnusable(f"{MANIFEST} is not readable") from None
    for fname, data in files.items():
        entry = entries.get(fname) if isinstance(entries, dict) else None
        if not isinstance(entry, dict):
            raise AdapterUnusable(f"{MANIFEST} does not list {fname}")
        if entry.get("bytes") != len(data) or entry.get("sha256") != hashlib.sha256(data).hexdigest():
            raise AdapterUnusable(f"{fname} does not match {MANIFEST} (size or sha256): a corrupt or partial upload")
