"""Qwen3-VL models built here, with no hub: the tiny one from a config, or random weights of the 8B's shape.

The tiny model's tokenizer is a byte-level BPE trained on this project's own dialogue text, its weights are
random from a seed, and `ensure_model` writes it once, in HF format, to a folder named by a hash of its shape
(written to a temporary folder and renamed, so actors on one machine that build it at the same time never see
half a model).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2VLImageProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from app.config import ModelConfig, TinyModelShape
from app.world import dialogue, episode, maze

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # rule 8: no hub at run time, even by accident
log = logging.getLogger(__name__)

# Qwen's special tokens, in Qwen's order; they follow the BPE vocabulary.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Qwen's ChatML; images render as <|vision_start|><|image_pad|><|vision_end|> and the processor
# expands the pad to one token per merged vision patch.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH = 16, 2, 2
PIXELS_PER_TOKEN = (PATCH_SIZE * MERGE_SIZE) ** 2  # one language-model token per 32x32 pixels


MODEL_FORMAT_VERSION = 5  # bump when the tiny model or its tokenizer corpus changes, so caches rebuild


def shape_key(shape: TinyModelShape) -> str:
    blob = json.dumps(asdict(shape), sort_keys=True) + f"|{MODEL_FORMAT_VERSION}"
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def model_folder(model_cfg: ModelConfig, cache_root: str | os.PathLike) -> Path:
    """Where the policy's base model is (or will be once `ensure_model` built it), creating nothing."""
    if model_cfg.path != "tiny":
        return Path(model_cfg.path)
    return Path(cache_root) / f"tiny-qwen3vl-{shape_key(model_cfg.tiny)}"


def ensure_model(model_cfg: ModelConfig, cache_root: str | os.PathLike) -> Path:
    """The folder of the policy's base model: `model.path` itself, or the tiny model built under cache_root."""
    if model_cfg.path != "tiny":
        return Path(model_cfg.path)
    out = model_folder(model_cfg, cache_root)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    started = time.perf_counter()
    log.info("building the tiny model (tokenizer, processor, random weights) in %s: about 10 s, once", out)
    try:
        build_tiny_model(model_cfg.tiny, tmp)
        log.info("tiny model built in %.0f s", time.perf_counter() - started)
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first; its model is identical
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------- tokenizer


def tokenizer_corpus() -> list[str]:
    """Text the tiny tokenizer learns merges from: everything the dialogue says, plus plain ASCII."""

    lines = [dialogue.SYSTEM_PROMPT]
    for turns in (5, 9, 15, 21, 31):
        for size in (5, 7, 9, 11):
            lines.append(dialogue.first_turn_text(turns, size))
    feedbacks = [episode.INVALID_ACTION_FEEDBACK, episode.SOLVED_FEEDBACK, episode.STOPPED_OFF_GOAL_FEEDBACK]
    for d in range(4):
        feedbacks += [
            episode.moved_feedback(d),
            episode.wall_feedback(d),
            episode.moved_feedback(d) + episode.OUT_OF_TURNS_SUFFIX,
        ]
    wheres = [None] + [dialogue.compass_text((0, 0), (r, c)) for r in range(-10, 11, 3) for c in range(-10, 11, 3)]
    wheres += [dialogue.route_hint(d) for d in maze.DIRECTION_NAMES]
    for fb in feedbacks:
        for left in range(0, 32):
            lines.append(dialogue.observation_text(fb, left, wheres[left % len(wheres)]))
    actions = [maze.Action.move(d) for d in range(4)] + [maze.Action.stop()]
    lines += [dialogue.format_action(a) for a in actions] * 20
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def build_tokenizer(vocab_size: int):

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=1 << 20
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---------------------------------------------------------------- the model


def tiny_config(shape: TinyModelShape, vocab_size: int, token_ids: dict[str, int]):

    text = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(shape.rope_theta),
            "mrope_interleaved": True,
            "mrope_section": _mrope_section(shape.head_dim),
        },
    )
    vision = dict(
        depth=shape.vision_depth,
        hidden_size=shape.vision_hidden_size,
        intermediate_size=2 * shape.vision_hidden_size,
        num_heads=shape.vision_heads,
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH,
        out_hidden_size=shape.hidden_size,
        num_position_embeddings=256,
        deepstack_visual_indexes=[0],
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        eos_token_id=token_ids["<|im_end|>"],
        pad_token_id=token_ids["<|endoftext|>"],
    )


def _mrope_section(head_dim: int) -> list[int]:
    """Splits head_dim/2 rotary frequencies over (time, height, width) as Qwen does (24/20/20 at 128)."""
    half = head_dim // 2
    hw = (half * 5) // 16
    return [half - 2 * hw, hw, hw]


def qwen3_vl_8b_config(vocab_size: int = 151936):
    """Qwen3-VL-8B's published shape (random weights are built from it for speed and memory work)."""

    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_interleaved": True,
                "mrope_section": [24, 20, 20],
            },
        ),
        vision_config=dict(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=4096,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[8, 16, 24],
        ),
        tie_word_embeddings=False,
    )


def build_8b_shaped_model(out_dir: str | os.PathLike, device: str = "cuda", seed: int = 0) -> Path:
    """Qwen3-VL-8B's shape with random bf16 weights (and this project's tokenizer, its ids padded into
    the 151,936-row vocabulary): for speed and memory work where the weights' values do not matter."""

    out = Path(out_dir)
    tokenizer = build_tokenizer(1024)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = qwen3_vl_8b_config()
    config.image_token_id, config.video_token_id = ids["<|image_pad|>"], ids["<|video_pad|>"]
    config.vision_start_token_id, config.vision_end_token_id = ids["<|vision_start|>"], ids["<|vision_end|>"]
    config.text_config.eos_token_id = config.eos_token_id = ids["<|im_end|>"]
    config.text_config.pad_token_id = config.pad_token_id = ids["<|endoftext|>"]
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration(config).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    model.save_pretrained(out)
    build_processor(tokenizer).save_pretrained(out)
    return out


def build_processor(tokenizer):

    # min_pixels is one merged patch so small maze images are not upscaled (Qwen's default would
    # blow a 160 px maze up to 256 px); Qwen3-VL normalises with mean = std = 0.5.
    image = Qwen2VLImageProcessor(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH,
        min_pixels=PIXELS_PER_TOKEN,
        max_pixels=PIXELS_PER_TOKEN * 1024,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    video = Qwen3VLVideoProcessor(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH)
    return Qwen3VLProcessor(
        image_processor=image, tokenizer=tokenizer, video_processor=video, chat_template=CHAT_TEMPLATE
    )


def build_tiny_model(shape: TinyModelShape, out_dir: str | os.PathLike) -> Path:
    """Writes a tiny Qwen3-VL (random weights from shape.seed), tokenizer, processor and chat template."""

    out = Path(out_dir)
    tokenizer = build_tokenizer(shape.vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = tiny_config(shape, len(tokenizer), ids)
    torch.manual_seed(shape.seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        # HF's init (std 0.02) caps a tiny model's logits near 2.5, so no token can ever pass ~1% and
        # the LoRA (which does not touch lm_head) could never make a reply likely. 1/sqrt(hidden) can.
        model.lm_head.weight.normal_(0.0, shape.hidden_size**-0.5)
    model.generation_config = GenerationConfig(
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], do_sample=False
    )
    model.save_pretrained(out)
    build_processor(tokenizer).save_pretrained(out)
    return out
