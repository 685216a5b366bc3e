"""What the driver checks before any actor starts, beyond the config file itself: what needs the model or the
storage to answer. Each failure is one ConfigError naming the field and the fix (exit code 2).

- the context budget: the longest conversation an episode can reach, measured with the model's own tokenizer
  and image processor, must fit `rollout.max_model_len` (a run never meets a context it cannot hold, and if model
  output ever makes one anyway, that episode ends as context_full, app/rollout/episodes.py);
- the storage: the checkpoint and export folders writable, the S3 bucket reachable with the credentials this
  machine has (they are first used at the first checkpoint, after every actor has started);
- the checkpoint a resume would load: its adapter must be the one `lora.*` describes (a run whose LoRA or
  trained vision tower changed since the checkpoint would otherwise fail in the trainers, after every actor
  started, or sample a differently scaled policy than it trains);
- what `model.adapter_init` holds, for `--plan`.
"""

from __future__ import annotations

import re
from pathlib import Path

from app.config import Config, ConfigError
from app.config.adapter_init import check_same_adapter, parse_adapter_config, read_adapter_init
from app.model.build import ensure_model, model_folder
from app.model.load import load_processor
from app.observe.efficiency import ModelFlops
from app.rollout.encoding import ChatCodec, as_image
from app.rollout.episodes import context_budget
from app.storage import S3Store, StorageUnavailable, checkpoint, open_store
from app.world.maze import generate_maze
from app.world.render import render
from app.world.rules import EpisodeSettings


def model_cache(cfg: Config) -> str:
    return str(Path(cfg.output_dir) / ".models")


def episode_context_budget(cfg: Config) -> int:
    """The longest context (prompt and replies, in tokens) an episode of this config can reach."""
    codec = ChatCodec(load_processor(ensure_model(cfg.model, model_cache(cfg))))
    return context_budget(codec, EpisodeSettings.from_config(cfg), cfg.rollout.max_new_tokens)


def check_context_budget(cfg: Config) -> int:
    need, r = episode_context_budget(cfg), cfg.rollout
    if need > r.max_model_len:
        raise ConfigError(
            "rollout.max_model_len",
            f"it is {r.max_model_len}, but an episode can reach {need} tokens ({r.max_turns} turns, "
            f"{r.max_new_tokens}-token replies, image_history {r.image_history}, turn_history {r.turn_history})",
            f"raise rollout.max_model_len to {need}, or shorten the episode (rollout.max_turns, "
            "rollout.max_new_tokens) or its context (rollout.image_history, rollout.turn_history)",
        )
    return need


def check_storage(cfg: Config) -> None:
    ck = cfg.checkpoint
    places = [("checkpoint.ckpt_path", ck.ckpt_path), ("checkpoint.export_dir", ck.export_dir)]
    if ck.s3_uri:
        places.append(("checkpoint.s3_uri", f"{ck.s3_uri.rstrip('/')}/checkpoints"))
    for field, where in places:
        # a few seconds at most: an endpoint that does not answer at the start will not answer better later
        store = (
            S3Store(where, ck.s3_endpoint_url, max_attempts=2, connect_timeout=5) if field.endswith("s3_uri") else None
        )
        try:
            (store or open_store(where)).check()
        except StorageUnavailable as e:
            fix = (
                "check that the bucket exists and that this machine's credentials (AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, ~/.aws, or an instance role) reach it at checkpoint.s3_endpoint_url; "
                "or leave checkpoint.s3_uri out"
                if field == "checkpoint.s3_uri"
                else "point it at a folder this machine can write"
            )
            raise ConfigError(field, f"{e.reason} ({e})", fix) from None


def check_resume(cfg: Config) -> str | None:
    """The checkpoint the run would resume from (its location; None: it starts afresh), refused with the `lora.*`
    field to change when its adapter is not the one the config describes. The same order as the consolidator's
    resume: `checkpoint.resume_path` for resume_mode path, else the shared directory, then S3."""
    ck = cfg.checkpoint
    if ck.resume_mode == "none":
        return None
    if ck.resume_mode == "path":
        parent, _, last = ck.resume_path.rstrip("/").rpartition("/")
        named = re.fullmatch(r"global_step_\d+", last) is not None  # a step folder, else a root of them
        places = [(parent or ".", last)] if named else [(ck.resume_path, None)]
    else:
        places = [(ck.ckpt_path, None)] + ([(f"{ck.s3_uri.rstrip('/')}/checkpoints", None)] if ck.s3_uri else [])
    for root, name in places:
        try:
            s3 = root.startswith("s3://")
            store = S3Store(root, ck.s3_endpoint_url, max_attempts=2, connect_timeout=5) if s3 else open_store(root)
            found = checkpoint.resumed_adapter_config(store, name)
        except StorageUnavailable:
            continue  # the resume tries the next place too; check_storage names an unreachable bucket
        if found is None:
            continue
        where = store.uri(found[0])
        afresh = f"start afresh (checkpoint.resume_mode=none, or another checkpoint.ckpt_path than {root})"
        try:
            adapter = parse_adapter_config(found[1], where)
        except ConfigError as e:
            raise ConfigError("checkpoint.resume_mode", f"the checkpoint {where}: {e.problem}", afresh) from None
        check_same_adapter(adapter, cfg.lora, f"the checkpoint it resumes from ({where})", f", or {afresh}")
        return where
    return None


def describe_preflight(cfg: Config) -> list[str]:
    """The lines --plan adds, where they can be known without creating anything: the adapter the run starts from,
    and the context budget once the model folder exists (a tiny model is built at the run's start)."""
    lines = []
    if cfg.model.adapter_init:
        if (Path(cfg.model.adapter_init) / "adapter_config.json").is_file():
            found = read_adapter_init(cfg.model.adapter_init)
            lines.append(f"adapter_init: {cfg.model.adapter_init}: {found.describe()}, as lora.* says")
        else:
            lines.append(f"adapter_init: {cfg.model.adapter_init} (not on this machine: checked at the run's start)")
    model_dir = cfg.model.path if cfg.model.path != "tiny" else model_folder(cfg.model, model_cache(cfg))
    if (Path(model_dir) / "config.json").is_file():
        need = episode_context_budget(cfg)
        lines.append(
            f"context: an episode reaches at most {need} tokens (rollout.max_model_len {cfg.rollout.max_model_len})"
        )
    else:
        lines.append("context: measured against rollout.max_model_len at the run's start, once the model is there")
    return lines


def model_flops(cfg: Config) -> ModelFlops:
    """The model's FLOP counts (app/observe/efficiency.py): its parameters, and the patches of one maze picture."""
    model_dir = str(ensure_model(cfg.model, model_cache(cfg)))
    codec = ChatCodec(load_processor(model_dir))
    image = as_image(render(generate_maze(0, cfg.maze.size), (1, 1), cfg.maze.cell_px))
    t, h, w = codec.image_grid(image)
    return ModelFlops.for_model(model_dir, t * h * w)
