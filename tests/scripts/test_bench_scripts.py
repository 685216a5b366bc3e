"""The benchmark helpers that run without a GPU: py-spy profiles summarised."""

from __future__ import annotations


def test_profile_summary_counts_inclusive_and_self_samples(tmp_path):
    from scripts.bench.profile_summary import read_stacks, summarize

    text = (
        "<module> (main.py:1);play_episodes (/a/app/episodes.py:150);generate (/a/vllm.py:120) 30\n"
        "<module> (main.py:1);play_episodes (/a/app/episodes.py:151);advance (/a/app/episodes.py:99) 10\n"
        "<module> (main.py:1);wait (threading.py:300) 60\n"
        "not a stack line\n"
    )
    stacks = read_stacks(text)
    assert len(stacks) == 3 and stacks[0][0][1] == "play_episodes (episodes.py)"
    whole = summarize(stacks)
    assert whole["samples"] == 100 and whole["inclusive"]["play_episodes (episodes.py)"] == 40
    assert whole["self"]["wait (threading.py)"] == 60
    rollout = summarize(stacks, under="play_episodes")
    assert rollout["samples"] == 40 and rollout["self"]["generate (vllm.py)"] == 30
