"""Plays many maze episodes at once over an engine, turn by turn, and returns their trajectories.

Each reply is decoded only to find the action (the sampled ids stay as sampled), the maze steps, and the next
observation segment is appended; the episode's next context goes back to the engine until the episode ends. When
contexts meet the engine is the engine's schedule (Engine.stream): every open episode's turn in one batch
(lockstep), or each episode's next turn as soon as its reply arrives (continuous).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

from PIL import Image

from app.rollout.encoding import ChatCodec, Segment, as_image, image_to_png
from app.rollout.engines.base import Engine, Generation, Prompt, Sampling
from app.rollout.trajectory import Trajectory, build_sequence
from app.world import dialogue
from app.world.episode import CONTEXT_FULL, INVALID_ACTION_FEEDBACK, OUT_OF_TURNS_SUFFIX, MazeEpisode, wall_feedback
from app.world.maze import DIRECTION_NAMES, Cell, Maze, generate_maze
from app.world.render import render
from app.world.rules import EpisodeSettings


@dataclass(frozen=True)
class EpisodeRequest:
    maze: Maze
    group: int = 0
    sample: int = 0


class Picture(NamedTuple):
    image: Image.Image
    png: bytes
    identity: str  # a digest of the PNG: equal pixels, equal ids (vLLM's multi_modal_uuids)


class Pictures:
    """Each (maze, cell) picture rendered, PNG-encoded and identified once, however many episodes stand there.

    The 8 runs of a group play one maze, so a rollout shows ~2.3k pictures of only ~400 distinct states; PNG
    encoding alone was 16% of a GPU rollout's time (py-spy, docs/BENCHMARKS.md), and vLLM hashing
    every picture's pixels ~4%: a prompt names its pictures by these ids instead. The ids digest the (lossless,
    deterministic) PNG, so they follow the content and two different pictures never share one. The images are
    shared read-only: nothing downstream draws on them.
    """

    def __init__(self, cell_px: int):
        self.cell_px = cell_px
        self._made: dict[tuple[str, Cell], Picture] = {}

    def of(self, maze: Maze, cell: Cell) -> Picture:
        key = (maze.identity, tuple(cell))
        made = self._made.get(key)
        if made is None:
            image = as_image(render(maze, cell, self.cell_px))
            png = image_to_png(image)
            made = self._made[key] = Picture(image, png, "png-" + hashlib.blake2b(png, digest_size=16).hexdigest())
        return made


class RunningEpisode:
    """One episode in flight: the maze, the full segment history, and the current context view."""

    def __init__(
        self, request: EpisodeRequest, codec: ChatCodec, settings: EpisodeSettings, pictures: Pictures | None = None
    ):
        self.request, self.codec, self.settings = request, codec, settings
        self.pictures = pictures or Pictures(settings.cell_px)
        self.env = MazeEpisode(request.maze, settings.max_turns)
        picture = self.pictures.of(self.env.maze, self.env.position)
        self.history: list[Segment] = [
            codec.opening(picture.image, settings.max_turns, settings.maze_size, self._where())
        ]
        self.image_count = 1
        self.pngs = [picture.png]
        self.picture_ids = [picture.identity]  # by image index, as pngs
        self.first_trained = 0  # history index from which generated segments belong to the current sequence
        self.sequences = []
        self.replies: list[str] = []
        self.actions: list[str | None] = []
        self.states: list[str] = []  # the cell each turn's action was chosen in (app.learning.step_advantages)
        self.truncated = 0

    def _where(self) -> str | None:
        return dialogue.where_text(self.settings.feedback, self.env.maze, self.env.position)

    def _view(self) -> tuple[list[Segment], list[int], int]:
        """The context as the model sees it: images outside the window replaced by a short note, turns
        outside the turn window left out. Also returns how many history segments were left out."""
        k = self.settings.image_history
        oldest_kept = self.image_count - k if k else 0
        # history = [opening, reply, observation, reply, observation, ..., (a last reply)]
        dropped = 2 * dialogue.dropped_turns(self.image_count - 1, self.settings.turn_history)
        view, offsets, image_index = [], [], 0
        for index, seg in enumerate(self.history):
            if 1 <= index <= dropped:
                image_index += len(seg.images)
                continue
            if not seg.images:
                view.append(seg)
                continue
            if image_index >= oldest_kept:
                view.append(seg)
                offsets.append(image_index)
            else:
                view.append(Segment(seg.without_images, generated=False))
            image_index += len(seg.images)
        return view, offsets, dropped

    def prompt(self) -> Prompt:
        view, offsets, _ = self._view()
        ids = [i for seg in view for i in seg.token_ids]
        with_images = [seg for seg in view if seg.images]  # offsets holds each one's first image index
        image_ids = [
            self.picture_ids[first + k] for seg, first in zip(with_images, offsets) for k in range(len(seg.images))
        ]
        return Prompt(ids, [img for seg in with_images for img in seg.images], image_ids)

    def _close_sequence(self) -> None:
        view, offsets, dropped = self._view()
        first = self.first_trained - dropped  # a window move closes the sequence first: nothing trained was dropped
        if any(seg.generated for seg in view[first:]):
            self.sequences.append(build_sequence(view, first, offsets))

    def end_for_context(self) -> None:
        """The next prompt would not fit max_model_len: the episode ends here (outcome context_full, reward 0).
        The observation that did not fit leaves the history, so every sequence ends with a reply that fit."""
        if len(self.history) > 1 and not self.history[-1].generated:
            unseen = self.history.pop()
            if unseen.images:
                self.image_count -= 1
                del self.pngs[-len(unseen.images) :], self.picture_ids[-len(unseen.images) :]
        self.env.cut_short(CONTEXT_FULL)
        self._close_sequence()

    def advance(self, ids: list[int], logprobs: list[float], finish_reason: str, trained: bool = True) -> None:
        """trained=False: the reply is context only, never a training target (SFT's injected random moves)."""
        codec = self.codec
        self.history.append(Segment(list(ids), generated=trained, logprobs=list(logprobs)))
        reply = codec.decode(ids)
        action = dialogue.parse_action(reply)
        self.replies.append(reply)
        self.actions.append(dialogue.format_action(action) if action is not None else None)
        closed_by_model = bool(ids) and ids[-1] == codec.im_end_id
        self.truncated += 0 if closed_by_model else 1
        self.states.append("{},{}".format(*self.env.position))
        result = self.env.step(action)
        if result.done:
            self._close_sequence()
            return
        picture = self.pictures.of(self.env.maze, self.env.position)
        observation = codec.observation(
            picture.image, result.feedback, self.env.turns_left, close_turn=not closed_by_model, where=self._where()
        )
        k = self.settings.image_history
        observations = self.image_count  # observations in the history once this one is appended
        if (k and observations + 1 > k) or dialogue.dropped_turns(observations, self.settings.turn_history):
            # The oldest image or turn leaves the window: the context changes before this point, so the
            # sequence so far is complete and the next one starts from the rebuilt context.
            self._close_sequence()
            self.first_trained = len(self.history) + 1
        self.history.append(observation)
        self.image_count += 1
        self.pngs.append(picture.png)
        self.picture_ids.append(picture.identity)

    def trajectory(self, lora_version: int) -> Trajectory:
        maze, env = self.request.maze, self.env
        return Trajectory(
            maze_seed=maze.seed,
            maze_id=maze.identity,
            group=self.request.group,
            sample=self.request.sample,
            images=self.pngs,
            sequences=self.sequences,
            replies=self.replies,
            actions=self.actions,
            reward=env.reward,
            outcome=env.outcome,
            turns=env.turns,
            moves=env.moves,
            invalid_actions=env.invalid_actions,
            optimal_moves=maze.shortest_path_length,
            solvable=maze.solvable_within(self.settings.max_turns),
            lora_version=lora_version,
            truncated_replies=self.truncated,
            states=list(self.states),
        )


def play_episodes(
    engine: Engine, codec: ChatCodec, requests: list[EpisodeRequest], settings: EpisodeSettings, sampling: Sampling
) -> list[Trajectory]:
    """Plays every request to its end through the engine's schedule (Engine.stream); trajectories come back in
    request order."""
    pictures = Pictures(settings.cell_px)
    running = [RunningEpisode(r, codec, settings, pictures) for r in requests]

    def next_prompt(i: int) -> Prompt | None:
        episode = running[i]
        if episode.env.done:
            return None
        prompt = episode.prompt()
        if len(prompt.token_ids) + sampling.max_new_tokens > settings.max_model_len:
            episode.end_for_context()  # a reply must fit too: the engine refuses a prompt it cannot finish
            return None
        return prompt

    def on_reply(i: int, reply: Generation) -> Prompt | None:
        running[i].advance(reply.token_ids, reply.logprobs, reply.finish_reason)
        return next_prompt(i)

    first = {i: prompt for i in range(len(running)) if (prompt := next_prompt(i)) is not None}
    engine.stream(first, sampling.for_turn, on_reply)
    return [r.trajectory(engine.lora_version) for r in running]


def context_budget(codec: ChatCodec, settings: EpisodeSettings, max_new_tokens: int) -> int:
    """The longest context an episode can reach, from the longest texts the dialogue can produce."""

    maze = generate_maze(0, settings.maze_size)
    image = as_image(MazeEpisode(maze, settings.max_turns).image(settings.cell_px))
    wheres: list[str | None] = [None]
    if settings.feedback == "compass":
        far = settings.maze_size - 3
        wheres = [dialogue.compass_text((0, 0), (far, far))]
    elif settings.feedback == "route":
        wheres = [dialogue.route_hint(d) for d in DIRECTION_NAMES] + [dialogue.ON_GOAL_TEXT]
    openings = [codec.opening(image, settings.max_turns, settings.maze_size, where) for where in wheres]
    opening = max(openings, key=lambda segment: len(segment.token_ids))
    longest_feedback = (
        max([INVALID_ACTION_FEEDBACK] + [wall_feedback(d) for d in range(4)], key=len) + OUT_OF_TURNS_SUFFIX
    )
    observations = [
        codec.observation(image, longest_feedback, settings.max_turns, close_turn=True, where=where) for where in wheres
    ]
    obs = max(observations, key=lambda segment: len(segment.token_ids))
    k = settings.image_history
    turns_after_first = settings.max_turns - 1
    in_view = turns_after_first - dialogue.dropped_turns(turns_after_first, settings.turn_history)
    keeps_all = not k or k >= in_view + 1  # at the last turn the window holds the newest k images
    with_image = in_view if keeps_all else min(k, in_view)
    total = len(opening.token_ids) if keeps_all else len(opening.without_images)
    total += with_image * len(obs.token_ids) + (in_view - with_image) * len(obs.without_images)
    return total + (in_view + 1) * max_new_tokens
