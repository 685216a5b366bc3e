"""Two costs vLLM's front end pays for every request with a picture, cut for the releases that pay them.

The front end (vllm.multimodal.processing.processor) prepares a turn's requests one after another in the process
that calls the engine, while the engine core waits for them: on the 8B workload it was 41% of the episode loop's
samples (py-spy, one H100, 2026-12-05: docs/BENCHMARKS.md). Two parts of it do work that gives nothing:

- **The placeholder scans.** `iter_token_matches` finds the `<|image_pad|>` to expand, `_iter_placeholders` then
  finds the expanded run; vLLM 0.26, the GPU stack's release, compares a list slice at every position of the
  prompt in both (13% of the loop's samples with the whole history in each turn's prompt). Later releases jump to
  candidates with `list.index` in the first and still step one position at a time in the second. The scans here
  jump in both, with the same results, for either signature `_iter_placeholders` has had.
- **The HF processor called for no pictures.** When every picture of a request is in vLLM's processor cache (a
  GRPO group's shared first picture, an agent that bumped into a wall: equal content ids), vLLM 0.26 still runs the
  model's HF processor on an empty dummy prompt to process "the missing pictures" (8% of the loop's samples); later
  releases skip the call. Its output depends only on the processor and its keyword arguments, so it is computed once
  and a copy returned after that.

`install()` applies each where the installed module has the form it was written for and leaves any other form as it
is; vLLM has no option for either. tests/rollout/test_vllm_front_end.py compares the scans with the installed
release's own on random prompts.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Iterator, Sequence

log = logging.getLogger(__name__)

_ORIGINALS = "_mazerl_original_scans"  # where install() keeps vLLM's own scans, on the module itself
_EMPTY_CALL = "_mazerl_original_mm_only"  # and the processor class's own method, on the class
_EMPTY_MEMO = "_mazerl_mm_only_for_no_items"  # each processor's outputs for no items, by keyword arguments


def token_matches(token_ids: Sequence[int], match_ids: Sequence[int], start_idx: int = 0) -> Iterator[tuple[int, int]]:
    """(start, end) of each occurrence of `match_ids` in `token_ids` from `start_idx`, leftmost first and not
    overlapping; an empty `match_ids` matches nothing."""
    if start_idx < 0:
        raise ValueError("start_idx must be non-negative")
    ids = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)
    size = len(match_ids)
    if size == 0:
        return
    first, last = match_ids[0], len(ids) - size
    while start_idx <= last:
        try:
            start_idx = ids.index(first, start_idx, last + 1)
        except ValueError:
            return
        end = start_idx + size
        if ids[start_idx:end] == match_ids:  # the comparison vLLM makes
            yield start_idx, end
            start_idx = end
        else:
            start_idx += 1


def _next_of(ids: Sequence[int], firsts: set[int], start: int) -> int:
    """The first position from `start` holding one of `firsts`, or len(ids)."""
    best = len(ids)
    for token in firsts:
        try:
            best = ids.index(token, start, best)
        except ValueError:
            continue
    return best


def placeholder_scan(processor_module, takes_tokenizer: bool):
    """vLLM's `_iter_placeholders` for `processor_module`: the placeholder runs found in a prompt, in vLLM's
    order (an earlier modality's update first), exclusive, each item of a modality after the one before."""
    info, all_found = processor_module.PlaceholderFeaturesInfo, processor_module._all_items_found

    def scan(prompt, mm_prompt_updates, tokenizer=None):
        def tokens_of(content):
            return processor_module._seq2tokens(tokenizer, content.full) if takes_tokenizer else content.full

        def is_embed_of(content):
            if content.is_embed is None:
                return None
            return content.is_embed(tokenizer, content.full) if takes_tokenizer else content.is_embed(content.full)

        counts = {m: len(items) for m, items in mm_prompt_updates.items()}
        found = {m: 0 for m in mm_prompt_updates}
        if all_found(counts, found):
            return
        ids = prompt if isinstance(prompt, (list, tuple)) else list(prompt)
        size, start, candidates = len(ids), 0, None
        while start < size:
            if candidates is None:  # the current item's updates of each modality: rebuilt after each match
                candidates = [
                    (modality, update.content, tokens_of(update.content))
                    for modality, items in mm_prompt_updates.items()
                    if found[modality] < counts.get(modality, 0)
                    for update in items[found[modality]]
                ]
                candidates = [c for c in candidates if len(c[2])]  # an empty run never matches
                if not candidates:
                    return
                firsts = {c[2][0] for c in candidates}
            start = _next_of(ids, firsts, start)  # no run can start where none of their first tokens is
            if start >= size:
                return
            for modality, content, tokens in candidates:
                end = start + len(tokens)
                if end <= size and ids[start:end] == tokens:  # the comparison vLLM makes
                    yield info(
                        modality=modality,
                        item_idx=found[modality],
                        start_idx=start,
                        tokens=tokens,
                        is_embed=is_embed_of(content),
                    )
                    start, candidates = end, None
                    found[modality] += 1
                    if all_found(counts, found):
                        return
                    break
            else:
                start += 1

    return scan


def install(processor_module=None) -> set[str]:
    """Puts the pieces above into vLLM's processor module (the installed one by default) where it has the form
    each was written for; returns those in place ("scans", "empty processor call"). Idempotent."""
    if processor_module is None:
        from vllm.multimodal.processing import processor as processor_module
    done = set()
    if _install_scans(processor_module):
        done.add("scans")
    if _install_empty_call_memo(getattr(processor_module, "BaseMultiModalProcessor", None)):
        done.add("empty processor call")
    return done


def _install_scans(processor_module) -> bool:
    if hasattr(processor_module, _ORIGINALS):
        return True
    try:
        original_matches = processor_module.iter_token_matches
        original_placeholders = processor_module._iter_placeholders
        token_match = processor_module._TokenMatch
        params = list(inspect.signature(original_placeholders).parameters)
        match_params = list(inspect.signature(original_matches).parameters)
    except (AttributeError, TypeError, ValueError) as e:
        log.info("vLLM's placeholder scans kept: %s", e)
        return False
    if match_params != ["token_ids", "match_ids", "start_idx"] or params not in (
        ["prompt", "mm_prompt_updates", "tokenizer"],
        ["prompt", "mm_prompt_updates"],
    ):
        log.info("vLLM's placeholder scans kept: unknown forms %s, %s", match_params, params)
        return False

    def iter_token_matches(token_ids, match_ids, *, start_idx=0):
        for start, end in token_matches(token_ids, match_ids, start_idx):
            yield token_match(start_idx=start, end_idx=end)

    setattr(processor_module, _ORIGINALS, (original_matches, original_placeholders))
    processor_module.iter_token_matches = iter_token_matches
    processor_module._iter_placeholders = placeholder_scan(processor_module, takes_tokenizer=len(params) == 3)
    return True


def _install_empty_call_memo(processor_class) -> bool:
    """vLLM 0.26's `_apply_hf_processor_mm_only(self, mm_items, hf_processor_mm_kwargs, tokenization_kwargs)`:
    with no items its result is the HF processor's output for an empty dummy prompt, the same on every call."""
    if processor_class is None:
        return False
    if _EMPTY_CALL in vars(processor_class):
        return True
    original = vars(processor_class).get("_apply_hf_processor_mm_only")
    if original is None:  # later releases skip the call themselves
        return False
    params = list(inspect.signature(original).parameters)
    if params != ["self", "mm_items", "hf_processor_mm_kwargs", "tokenization_kwargs"]:
        log.info("vLLM's processor call kept: unknown form %s", params)
        return False

    def _apply_hf_processor_mm_only(self, mm_items, hf_processor_mm_kwargs, tokenization_kwargs):
        if any(mm_items.get_all_counts().values()):
            return original(self, mm_items, hf_processor_mm_kwargs, tokenization_kwargs)
        memo = self.__dict__.setdefault(_EMPTY_MEMO, {})
        key = (repr(sorted(hf_processor_mm_kwargs.items())), repr(sorted(tokenization_kwargs.items())))
        if key not in memo:
            memo[key] = original(self, mm_items, hf_processor_mm_kwargs, tokenization_kwargs)
        return copy.deepcopy(memo[key])  # callers may update what they get

    setattr(processor_class, _EMPTY_CALL, original)
    processor_class._apply_hf_processor_mm_only = _apply_hf_processor_mm_only
    return True


def originals(processor_module) -> tuple:
    """vLLM's own (iter_token_matches, _iter_placeholders) of a module, whether or not install() changed it."""
    return getattr(
        processor_module, _ORIGINALS, (processor_module.iter_token_matches, processor_module._iter_placeholders)
    )
