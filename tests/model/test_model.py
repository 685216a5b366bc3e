"""The tiny Qwen3-VL built locally, loading, LoRA on the language model only, and the chat encoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.config import LoraSettings, ModelConfig, TinyModelShape
from app.model import adapters
from app.model.build import SPECIAL_TOKENS, ensure_model, shape_key
from app.model.load import VISION_TOKENS, apply_lora, load_model, load_processor, lora_state_dict
from app.rollout.encoding import as_image
from app.world import dialogue
from app.world.episode import MazeEpisode
from app.world.maze import generate_maze


def test_tiny_model_folder_is_complete_hf_format(tiny_model_dir):
    files = {p.name for p in Path(tiny_model_dir).iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "processor_config.json",
        "chat_template.jinja",
    } <= files
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert config["text_config"]["head_dim"] == 32  # vLLM's CPU attention supports it
    assert sum(config["text_config"]["rope_parameters"]["mrope_section"]) == 16
    assert config["text_config"]["rope_parameters"]["rope_theta"] == TinyModelShape().rope_theta == 5_000_000.0


def test_rope_base_is_a_shape_knob():
    from app.model.build import tiny_config

    config = tiny_config(TinyModelShape(rope_theta=10_000.0), 1100, {t: i for i, t in enumerate(SPECIAL_TOKENS)})
    assert config.text_config.rope_parameters["rope_theta"] == 10_000.0
    assert shape_key(TinyModelShape(rope_theta=10_000.0)) != shape_key(TinyModelShape())  # a different model folder


def test_build_is_deterministic_and_cached(tmp_path, tiny_model_dir):
    again = ensure_model(ModelConfig(), tmp_path)
    a = load_model(tiny_model_dir).state_dict()
    b = load_model(again).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (Path(tiny_model_dir) / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()
    assert ensure_model(ModelConfig(), tmp_path) == again  # second call reuses the folder
    other = ModelConfig(tiny=TinyModelShape(seed=1))
    assert shape_key(other.tiny) != shape_key(ModelConfig().tiny)


def test_special_tokens_and_chat_template(processor):
    tok = processor.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS) and tok.unk_token_id not in ids
    text = processor.apply_chat_template(
        [dialogue.system_message(), dialogue.first_user_message(15, 9)], add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 1


def test_encoding_matches_processor_and_template(processor, codec):
    """Segments concatenated = the chat template rendered and tokenized by the processor, ids and all."""
    maze = generate_maze(3, 7)
    episode = MazeEpisode(maze, 12)
    first = as_image(episode.image(32))
    reply = "('move', 0)"
    result = episode.step(dialogue.parse_action(reply))
    second = as_image(episode.image(32))
    messages = [
        dialogue.system_message(),
        dialogue.first_user_message(12, 7),
        dialogue.assistant_message(reply),
        dialogue.observation_message(result.feedback, episode.turns_left),
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    expected = processor(text=[text], images=[first, second], return_tensors="pt")
    segments = [
        codec.opening(first, 12, 7),
        codec.reply_segment(reply),
        codec.observation(second, result.feedback, episode.turns_left, close_turn=False),
    ]
    ids = [i for s in segments for i in s.token_ids]
    assert ids == expected["input_ids"][0].tolist()
    vision = codec.vision_inputs([first, second])
    assert torch.equal(vision["pixel_values"], expected["pixel_values"])
    assert torch.equal(vision["image_grid_thw"], expected["image_grid_thw"])
    assert codec.mm_token_type_ids(torch.tensor([ids]))[0].tolist() == expected["mm_token_type_ids"][0].tolist()


def test_one_vision_token_per_32px_cell(codec):
    image = as_image(MazeEpisode(generate_maze(0, 7), 12).image(32))
    assert codec.image_tokens(image) == 7 * 7


def test_lora_covers_language_model_only(tiny_model_dir, tiny_lora):
    model = apply_lora(load_model(tiny_model_dir), tiny_lora)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and ".language_model." in n for n in names)
    assert not any(".visual." in n for n, _ in model.named_parameters() if "lora_" in n)
    spec = adapters.AdapterSpec.for_model(model.config.text_config, tiny_lora)
    adapters.validate(lora_state_dict(model), spec)


def test_vision_targets_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="outside the language model"):
        apply_lora(load_model(tiny_model_dir), LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "qkv"]))


def test_lora_save_and_reload_gives_identical_logits(tmp_path, tiny_model_dir, processor, tiny_lora, codec):
    from peft import PeftModel

    torch.manual_seed(0)
    model = apply_lora(load_model(tiny_model_dir), tiny_lora)
    with torch.no_grad():  # B starts at zero; make the adapter matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(load_model(tiny_model_dir), tmp_path / "adapter")
    ours = adapters.write_peft_folder(
        lora_state_dict(model), adapters.AdapterSpec.for_model(model.config.text_config, tiny_lora), tmp_path / "ours"
    )
    reloaded_ours = PeftModel.from_pretrained(load_model(tiny_model_dir), ours)
    image = as_image(MazeEpisode(generate_maze(1, 7), 12).image(32))
    ids = torch.tensor([codec.opening(image, 12, 7).token_ids])
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": codec.mm_token_type_ids(ids),
        **codec.vision_inputs([image]),
    }
    with torch.no_grad():
        base_logits = load_model(tiny_model_dir)(**inputs).logits
        logits = [m.eval()(**inputs).logits for m in (model, reloaded, reloaded_ours)]
    assert not torch.equal(base_logits, logits[0])
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_vision_tokens_are_special(processor):
    tok = processor.tokenizer
    for t in VISION_TOKENS:
        assert tok.encode(t, add_special_tokens=False) == [tok.convert_tokens_to_ids(t)]


def test_load_processor_and_model_from_path(tiny_model_dir):
    proc = load_processor(tiny_model_dir)
    assert proc.image_processor.patch_size == 16 and proc.image_processor.merge_size == 2
    assert load_model(tiny_model_dir).config.model_type == "qwen3_vl"
