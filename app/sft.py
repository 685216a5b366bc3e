"""Supervised warm start: BFS-solver demonstrations in exactly the RL episode format.

A demonstration is an episode played by the solver through the same dialogue, segments and trajectory
layout as a rollout: the loss mask covers the solver's replies (each `('move', d)` / `('stop', 'stop')`
and its `<|im_end|>`), so SFT and GRPO train the same tokens in the same contexts. Training mazes only:
demonstrations come from the same `MazeSampler` that never yields an eval maze.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

from app import dialogue
from app.encoding import ChatCodec
from app.episodes import EpisodeRequest, EpisodeSettings, RunningEpisode
from app.maze import Maze
from app.trajectory import Trajectory


def demonstration(maze: Maze, codec: ChatCodec, settings: EpisodeSettings, group: int = 0) -> Trajectory:
    """The solver's episode on `maze` (it stops on the goal, or runs out of turns if the maze needs more)."""
    episode = RunningEpisode(EpisodeRequest(maze, group, 0), codec, settings)
    for action in dialogue.solver_actions(maze):
        if episode.env.done:
            break
        reply = codec.reply_segment(dialogue.demo_reply(action))
        episode.advance(reply.token_ids, [0.0] * len(reply.token_ids), "stop")
    return episode.trajectory(lora_version=-1)


def demonstrations(mazes: list[Maze], codec: ChatCodec, settings: EpisodeSettings) -> list[Trajectory]:
    return [demonstration(m, codec, settings, group=i) for i, m in enumerate(mazes)]


# Files of a model folder that the weights export rewrites; everything else (tokenizer, processor, chat
# template) is copied from the base folder, so the export loads wherever the base did (vLLM included).
_WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def export_full_model(model, base_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16") -> Path:
    """The policy with its LoRA merged into the weights, as a model folder for `model.path`.

    This is the checkpoint of a full-model SFT (the analogue of the SFT checkpoint a GRPO run starts from).
    Written beside `out_dir` and renamed into place, so an interrupted export never leaves a half folder.
    """
    import torch

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    merged = copy.deepcopy(model)
    merged = merged.merge_and_unload() if hasattr(merged, "merge_and_unload") else merged
    merged.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
    for f in Path(base_dir).iterdir():
        if f.is_file() and f.name not in _WEIGHT_FILES and not f.name.endswith(".safetensors"):
            shutil.copy2(f, tmp / f.name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
