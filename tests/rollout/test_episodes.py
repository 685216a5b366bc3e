"""The episode loop: token in, token out; exact loss masks; image windows; bad output is an invalid move."""

from __future__ import annotations

import numpy as np
import pytest

from app.rollout.encoding import png_to_image
from app.rollout.engines.base import Sampling
from app.rollout.engines.scripted import MOVES, ScriptedEngine
from app.rollout.episodes import EpisodeRequest, context_budget, play_episodes
from app.rollout.trajectory import summarize
from app.world import dialogue
from app.world.maze import generate_maze
from app.world.rules import EpisodeSettings


def settings(k=0, turns=10, turn_history=0):
    return EpisodeSettings(
        max_turns=turns, maze_size=7, cell_px=32, image_history=k, max_model_len=4096, turn_history=turn_history
    )


def requests(n=64):
    return [EpisodeRequest(generate_maze(i // 8, 7), i // 8, i % 8) for i in range(n)]


@pytest.mark.parametrize("window,turn_window", [(0, 0), (1, 0), (3, 0), (0, 1), (1, 1), (3, 2)])
def test_masks_select_exactly_the_sampled_tokens(codec, window, turn_window):
    engine = ScriptedEngine(codec, seed=window + 10 * turn_window)
    trajectories = play_episodes(engine, codec, requests(), settings(window, turn_history=turn_window), Sampling(12))
    lengths = {t.turns for t in trajectories}
    assert len(lengths) > 3  # mixed lengths: episodes left the batch at different turns
    for t in trajectories:
        assert [codec.decode(ids) for ids in per_turn_ids(t)] == t.replies
        assert sum(s.num_loss_tokens for s in t.sequences) == sum(len(ids) for ids in per_turn_ids(t))
        for s in t.sequences:
            assert (s.rollout_logprobs[s.loss_mask == 0] == 0).all()
            assert (s.rollout_logprobs[s.loss_mask == 1] < 0).all()
            if window:
                assert len(s.image_indices) <= window
            if turn_window:  # the opening, the last turn_window turns, and the reply(s) being trained
                assert (s.token_ids == codec.im_end_id).sum() <= 2 * turn_window + 3
            assert (s.token_ids == codec.image_pad_id).sum() == sum(
                codec.image_tokens(png_to_image(t.images[i])) for i in s.image_indices
            )


def per_turn_ids(trajectory):
    """The generated ids of each turn, recovered from the masks (runs of 1s in turn order, deduplicated)."""
    turns, seen = [], 0
    for s in trajectory.sequences:
        runs, current = [], []
        for tok, m in zip(s.token_ids.tolist(), s.loss_mask.tolist()):
            if m:
                current.append(tok)
            elif current:
                runs.append(current)
                current = []
        if current:
            runs.append(current)
        turns.extend(runs)
        seen += len(runs)
    assert seen == trajectory.turns
    return turns


def test_token_in_token_out_prompts_are_prefixes(codec):
    """Without a window each prompt extends the previous one by exactly the sampled ids + an observation."""
    engine = ScriptedEngine(codec, seed=3)
    distinct = [EpisodeRequest(generate_maze(i, 7), i, 0) for i in range(8)]  # no two prompts alike
    trajectories = play_episodes(engine, codec, distinct, settings(0), Sampling(12))
    by_prefix = {}
    for prompt, gen in engine.log:
        for earlier, earlier_gen in by_prefix.items():
            if len(prompt) > len(earlier) and tuple(prompt[: len(earlier)]) == earlier:
                assert list(prompt[len(earlier) : len(earlier) + len(earlier_gen)]) == earlier_gen
        by_prefix[tuple(prompt)] = gen
    for t in trajectories:
        assert len(t.sequences) == 1
        final = t.sequences[0].token_ids.tolist()
        assert any(final[: len(p) - 1] == list(p[1:]) for p, _ in engine.log)


def test_each_turn_and_outcome_recorded(codec):
    engine = ScriptedEngine(codec, seed=5)
    trajectories = play_episodes(engine, codec, requests(32), settings(2, turns=6), Sampling(12))
    for t in trajectories:
        assert len(t.replies) == len(t.actions) == t.turns == len(t.images)
        assert t.outcome in ("solved", "stopped_off_goal", "out_of_turns")
        assert (t.outcome == "out_of_turns") == (t.turns == 6 and t.actions[-1] != "('stop', 'stop')")
        assert t.invalid_actions >= sum(a is None for a in t.actions)
        assert t.truncated_replies <= t.turns
    s = summarize(trajectories)
    assert s["episodes"] == 32 and 0 <= s["invalid_action_rate"] <= 1


def test_tiny_model_garbage_is_invalid_moves(hf_engine, codec):
    """A random model speaks no action: every turn is an invalid move, and nothing crashes."""
    import torch

    hf_engine.load_lora({k: torch.zeros(s) for k, s in hf_engine.spec.shapes.items()}, 0)
    trajectories = play_episodes(hf_engine, codec, requests(64), settings(0, turns=3), Sampling(10, 1.0, seed=1))
    assert len(trajectories) == 64
    for t in trajectories:
        assert t.outcome == "out_of_turns" and t.turns == 3
        assert t.actions == [None, None, None] and t.invalid_actions == 3
        assert [codec.decode(ids) for ids in per_turn_ids(t)] == t.replies
        trained = t.sequences[0].token_ids[t.sequences[0].loss_mask == 1]
        assert not set(codec.forbidden_ids()) & set(trained.tolist())


def test_rollout_logprobs_are_the_engines(hf_engine, codec):
    import torch

    hf_engine.load_lora({k: torch.zeros(s) for k, s in hf_engine.spec.shapes.items()}, 0)
    trajectories = play_episodes(hf_engine, codec, requests(4), settings(0, turns=2), Sampling(8, 1.0, seed=2))
    for t in trajectories:
        s = t.sequences[0]
        logps = s.rollout_logprobs[s.loss_mask == 1]
        assert len(logps) > 0 and np.all(logps < 0) and np.all(np.isfinite(logps))


@pytest.mark.parametrize("window,turn_window", [(0, 0), (2, 0), (0, 1), (1, 1), (3, 2)])
def test_context_budget_bounds_every_context(codec, window, turn_window):
    engine = ScriptedEngine(codec, seed=9)
    st = settings(window, turns=8, turn_history=turn_window)
    trajectories = play_episodes(engine, codec, requests(16), st, Sampling(12))
    longest = max(len(s.token_ids) for t in trajectories for s in t.sequences)
    assert longest <= context_budget(codec, st, 12)


@pytest.mark.parametrize("max_model_len", [100, 400])
def test_a_context_past_max_model_len_ends_that_episode_not_the_rollout(codec, max_model_len):
    """Model output decides how long a context grows: one that would pass max_model_len ends its episode
    (outcome context_full, reward 0), the others play on, and every ended episode is still a trajectory."""
    from app.rollout.trajectory import summarize
    from app.world.episode import CONTEXT_FULL

    engine = ScriptedEngine(codec, MOVES, cut_share=0.0, seed=2)  # moves only: contexts grow every turn
    st = EpisodeSettings(10, 7, 32, 0, max_model_len=max_model_len)
    trajectories = play_episodes(engine, codec, requests(8), st, Sampling(12))
    full = [t for t in trajectories if t.outcome == CONTEXT_FULL]
    assert full and all(t.reward == 0.0 for t in full)
    for t in trajectories:
        assert all(len(s.token_ids) <= max_model_len for s in t.sequences)
        assert t.turns == sum(1 for _ in t.replies) and t.turns < 10
    assert summarize(trajectories)["context_full_rate"] == len(full) / len(trajectories)
    assert all(len(p) - 1 + 12 <= max_model_len for p, _ in engine.log)  # (p: the picture hash + the prompt ids)


def test_a_turn_window_keeps_the_task_the_last_turns_and_the_current_picture(codec):
    """turn_history=1: every prompt after the first turn is the task statement, the last reply and the current
    observation, so contexts stop growing; each reply is trained exactly once, in the context it was sampled in."""
    st = settings(1, turns=10, turn_history=1)
    for seed in range(100):  # the first scripted episode that lasts (random replies include stop)
        engine = ScriptedEngine(codec, seed=seed)
        [t] = play_episodes(engine, codec, [EpisodeRequest(generate_maze(5, 7))], st, Sampling(12))
        if t.turns >= 6:
            break
    assert t.turns >= 6
    prompts = [list(p[1:]) for p, _ in engine.log]
    lengths = [len(p) for p in prompts[2:]]
    assert max(lengths) - min(lengths) <= 40  # the same, up to the lengths of replies and feedback texts
    assert max(len(p) for p in prompts) < len(prompts[0]) + 120
    start = codec.tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]
    pads = codec.image_tokens(png_to_image(t.images[0]))
    for prompt in prompts:
        assert dialogue.first_turn_text(10, 7) in codec.decode(prompt)  # the task statement stays
        assert prompt.count(start) <= 5  # system, task, one reply, one observation, the reply being asked for
        assert prompt.count(codec.image_pad_id) == pads  # the current picture only
    # every generated reply shows up trained in exactly one sequence, and that sequence is its prompt + reply
    trained = [s for s in t.sequences if s.num_loss_tokens]
    assert (
        len(trained) == len(t.sequences) == t.turns
    )  # one per reply: with one picture kept, the context moves each turn
    for s in t.sequences:
        ids = s.token_ids.tolist()
        first = s.loss_mask.tolist().index(1)
        assert any(ids[:first] == list(p[1:]) and ids[first:] == list(g) for p, g in engine.log)


def test_every_picture_shows_the_cell_its_turn_was_played_in_and_is_made_once_per_state(codec):
    from app.world.render import render

    engine = ScriptedEngine(codec, seed=11)
    reqs = requests(24)
    trajectories = play_episodes(engine, codec, reqs, settings(1, turns=8), Sampling(12))
    pngs = [png for t in trajectories for png in t.images]
    states = {(t.maze_id, cell) for t in trajectories for cell in t.states}
    assert len({id(png) for png in pngs}) == len(states) < len(pngs)  # one encoding per (maze, cell), shared
    for request, t in zip(reqs, trajectories):
        for png, cell in zip(t.images, t.states):
            row, col = map(int, cell.split(","))
            assert np.array_equal(np.asarray(png_to_image(png)), render(request.maze, (row, col), 32))


def test_the_codecs_text_cache_gives_the_tokenizers_ids_and_owned_lists(codec, processor):
    """ChatCodec caches each text's ids (every turn re-sends the same few texts): the same ids as the tokenizer,
    a fresh list each call (a caller's edit never reaches the cache), and a bounded cache that still pickles."""
    import pickle

    from app.rollout.encoding import ChatCodec

    fresh = ChatCodec(processor)
    text = "<|im_end|>\n<|im_start|>user\nYou moved up. 12 turns left.<|im_end|>\n<|im_start|>assistant\n"
    expected = processor.tokenizer.encode(text, add_special_tokens=False)
    first = fresh._encode(text)
    assert first == expected
    first.append(-1)  # the caller owns its list
    assert fresh._encode(text) == expected and fresh._encode(text) is not fresh._encode(text)
    fresh._ENCODED_MAX = 3
    for k in range(10):
        assert fresh._encode(f"turn {k}") == processor.tokenizer.encode(f"turn {k}", add_special_tokens=False)
    assert len(fresh._encoded) <= 3
    assert pickle.loads(pickle.dumps(fresh))._encode(text) == expected


@pytest.mark.parametrize("window,turn_window", [(0, 0), (3, 0), (1, 1), (3, 2)])
def test_each_prompt_names_its_pictures_by_their_content(codec, window, turn_window):
    """A prompt's image_ids (vLLM's multi_modal_uuids: the engine trusts them instead of hashing pixels) line up
    with its images under every context window: one id an image, the same id exactly for the same pixels."""
    import hashlib

    from app.rollout.encoding import image_to_png

    class Recording(ScriptedEngine):
        prompts = []

        def generate(self, prompts, sampling):
            self.prompts.extend(prompts)
            return super().generate(prompts, sampling)

    engine = Recording(codec, seed=5)
    play_episodes(engine, codec, requests(64), settings(window, turns=8, turn_history=turn_window), Sampling(12))
    by_id, turns_with_several = {}, 0
    for p in engine.prompts:
        assert p.image_ids is not None and len(p.image_ids) == len(p.images) >= 1
        turns_with_several += len(p.images) > 1
        for image, identity in zip(p.images, p.image_ids):
            png = image_to_png(image)
            assert identity == "png-" + hashlib.blake2b(png, digest_size=16).hexdigest()
            assert by_id.setdefault(identity, png) == png
    assert len(by_id) > 8  # 8 mazes, several states each: not one id for all
    assert (turns_with_several > 0) == (window != 1 and turn_window != 1)
