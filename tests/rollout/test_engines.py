"""The two engines behind one interface: same greedy tokens, same logprobs, the same in-memory LoRA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from actors.rollout import held_checksum, lora_checksum
from app.config import LoraSettings
from app.model import adapters
from app.model.load import VISION_TOKENS, lora_state_dict
from app.rollout.encoding import as_image
from app.rollout.engines.base import Prompt, Sampling
from app.world.episode import MazeEpisode
from app.world.maze import generate_maze

pytestmark = pytest.mark.vllm
LORA = LoraSettings(rank=8, alpha=16)  # tests/conftest.py's tiny_lora, which both engines are built with


def opening_prompts(codec, n=6, size=7):
    prompts = []
    for seed in range(n):
        image = as_image(MazeEpisode(generate_maze(seed, size), 12).image(32 if seed % 2 else 16))
        prompts.append(Prompt(codec.opening(image, 12, size).token_ids, [image]))
    return prompts


def random_adapter(spec, seed=1, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * scale for k, s in spec.shapes.items()}


def assert_same_generations(a, b, tol=1e-4):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < tol


@pytest.fixture(scope="module")
def prompts(codec):
    return opening_prompts(codec)


def test_greedy_tokens_and_logprobs_agree_base_model(hf_engine, vllm_engine, prompts):
    hf_engine.load_lora({k: torch.zeros(s) for k, s in hf_engine.spec.shapes.items()}, 0)
    vllm_engine.load_lora({k: torch.zeros(s) for k, s in vllm_engine.spec.shapes.items()}, 0)
    greedy = Sampling(max_new_tokens=16, temperature=0.0)
    assert_same_generations(hf_engine.generate(prompts, greedy), vllm_engine.generate(prompts, greedy))


def test_greedy_tokens_and_logprobs_agree_with_adapter(hf_engine, vllm_engine, prompts):
    tensors = random_adapter(hf_engine.spec)
    hf_engine.load_lora(tensors, 1)
    vllm_engine.load_lora(tensors, 1)
    greedy = Sampling(max_new_tokens=16, temperature=0.0)
    hf, vl = hf_engine.generate(prompts, greedy), vllm_engine.generate(prompts, greedy)
    assert_same_generations(hf, vl)
    # the adapter changed the outputs, so the comparison above is not base-vs-base
    hf_engine.load_lora({k: torch.zeros(s) for k, s in hf_engine.spec.shapes.items()}, 2)
    assert [g.token_ids for g in hf_engine.generate(prompts, greedy)] != [g.token_ids for g in hf]


def test_sampled_logprobs_are_the_tempered_distribution(hf_engine, vllm_engine, prompts):
    """Under sampling, each engine's logprob of its own sampled token equals the other's score of it."""
    tensors = random_adapter(hf_engine.spec, seed=2)
    hf_engine.load_lora(tensors, 3)
    vllm_engine.load_lora(tensors, 3)
    sampled = vllm_engine.generate(prompts[:2], Sampling(max_new_tokens=8, temperature=0.7, seed=5))
    for prompt, gen in zip(prompts[:2], sampled):
        # re-score vLLM's tokens with HF, one token at a time, greedily forced
        context = list(prompt.token_ids)
        for token, logp in zip(gen.token_ids, gen.logprobs):
            scored = score_next(hf_engine, context, prompt.images, token, 0.7)
            assert abs(scored - logp) < 1e-4
            context.append(token)


def score_next(engine, ids, images, token, temperature):
    from app.rollout.engines.base import logprobs_of

    t = torch.tensor([ids])
    inputs = {
        "input_ids": t,
        "attention_mask": torch.ones_like(t),
        "mm_token_type_ids": engine.codec.mm_token_type_ids(t),
        **engine.codec.vision_inputs(images),
    }
    with torch.no_grad():
        logits = engine.model(**inputs).logits[:, -1]
    return logprobs_of(logits, torch.tensor([token]), temperature, engine.forbidden).item()


def test_tensor_loaded_lora_equals_peft_folder_lora(tmp_path, tiny_model_dir, hf_engine, vllm_engine, prompts):
    """vLLM with the adapter pushed from memory = vLLM loading the PEFT folder = PEFT itself."""
    from peft import PeftModel
    from vllm.lora.request import LoRARequest

    from app.model.load import load_model

    tensors = random_adapter(vllm_engine.spec, seed=4)
    folder = adapters.write_peft_folder(tensors, vllm_engine.spec, tmp_path / "adapter")
    vllm_engine.load_lora(tensors, 4)
    greedy = Sampling(max_new_tokens=16, temperature=0.0)
    from_memory = vllm_engine.generate(prompts, greedy)
    # the official path, reading the folder, through the same engine
    request = vllm_engine._lora_request
    vllm_engine._lora_request = LoRARequest("from-folder", 999, str(folder))
    try:
        from_folder = vllm_engine.generate(prompts, greedy)
    finally:
        vllm_engine._lora_request = request
    assert [g.token_ids for g in from_memory] == [g.token_ids for g in from_folder]
    assert [g.logprobs for g in from_memory] == [g.logprobs for g in from_folder]
    # and PEFT's own loader in the transformers engine
    peft = PeftModel.from_pretrained(load_model(tiny_model_dir), str(folder))
    hf_engine.load_lora(lora_state_dict(peft), 5)
    assert_same_generations(from_memory, hf_engine.generate(prompts, greedy))


def test_caller_tensors_are_not_modified(vllm_engine, hf_engine):
    """vLLM scales lora_B in place; the engine must hand it private copies."""
    tensors = random_adapter(vllm_engine.spec, seed=6)
    before = {k: v.clone() for k, v in tensors.items()}
    vllm_engine.load_lora(tensors, 6)
    hf_engine.load_lora(tensors, 6)
    assert all(torch.equal(tensors[k], before[k]) for k in tensors)


@pytest.mark.parametrize("engine_name", ["hf_engine", "vllm_engine"])
def test_packed_adapter_loads_like_the_dict(request, engine_name, prompts):
    """What the rollout actor receives from the object store (one packed buffer) = the plain tensors."""
    engine = request.getfixturevalue(engine_name)
    tensors = random_adapter(engine.spec, seed=8)
    greedy = Sampling(max_new_tokens=12, temperature=0.0)
    engine.load_lora(tensors, 8)
    from_dict = engine.generate(prompts, greedy)
    packed = adapters.pack(tensors)
    before = packed.buffer.copy()
    engine.load_lora(packed, 9)
    assert [g.token_ids for g in engine.generate(prompts, greedy)] == [g.token_ids for g in from_dict]
    assert lora_checksum(engine.lora_state()) == held_checksum(tensors, LORA)
    assert (packed.buffer == before).all()  # vLLM's in-place scaling hit a private copy


@pytest.mark.parametrize("engine_name", ["hf_engine", "vllm_engine"])
def test_the_held_adapter_is_read_back_from_the_engine_itself(request, engine_name):
    """lora_state asks the engine what it generates with: an adapter changed inside the engine (vLLM: a LoRA slot
    in the worker's layers; transformers: the PEFT model's parameters) no longer matches the one it was given."""
    engine = request.getfixturevalue(engine_name)
    tensors = random_adapter(engine.spec, seed=10)
    engine.load_lora(tensors, 10)
    assert lora_checksum(engine.lora_state()) == held_checksum(tensors, LORA)
    assert set(engine.lora_state()) == set(adapters.held_form(tensors, LORA.rank, LORA.alpha, torch.float32))
    if engine_name == "vllm_engine":

        def nudge_one_slot(worker):
            manager = worker.model_runner.lora_manager._adapter_manager
            slot = manager.lora_index_to_id.index(12)
            layer = next(m for n, m in manager.modules.items() if n.endswith("layers.0.self_attn.qkv_proj"))
            layer.lora_b_stacked[1][slot, 0, 0, 0] += 1.0  # k_proj's lora_B, one element

        engine.llm.collective_rpc(nudge_one_slot)
    else:
        with torch.no_grad():
            next(p for n, p in engine.model.named_parameters() if "k_proj.lora_B" in n)[0, 0] += 1.0
    changed = engine.lora_state()
    assert lora_checksum(changed) != held_checksum(tensors, LORA)
    differ = [k for k, v in changed.items() if not torch.equal(v, held_form_of(tensors)[k])]
    assert differ == ["layers.0.self_attn.k_proj.lora_B"]


def held_form_of(tensors):
    return adapters.held_form(tensors, LORA.rank, LORA.alpha, torch.float32)


@pytest.mark.parametrize("engine_name", ["hf_engine", "vllm_engine"])
@pytest.mark.parametrize("damage", ["rank", "transposed", "missing", "extra", "nan"])
def test_adapter_of_wrong_shape_is_refused(request, engine_name, damage):
    engine = request.getfixturevalue(engine_name)
    tensors = random_adapter(engine.spec, seed=7)
    name = sorted(tensors)[0]
    if damage == "rank":
        tensors = {k: v[:4] if k.endswith("lora_A.weight") else v[:, :4] for k, v in tensors.items()}
    elif damage == "transposed":
        tensors[name] = tensors[name].t().contiguous()
    elif damage == "missing":
        del tensors[name]
    elif damage == "extra":
        tensors[name.replace("layers.0", "layers.9")] = tensors[name]
    else:
        tensors[name][0, 0] = float("nan")
    version = engine.lora_version
    with pytest.raises(adapters.AdapterMismatch, match="does not fit"):
        engine.load_lora(tensors, 100)
    assert engine.lora_version == version  # the refused adapter never reached the engine


# before the tests below: a second vLLM engine in this process ends the shared engine's parallel groups
def test_prompts_that_name_their_images_generate_the_same_and_the_names_are_used(vllm_engine, prompts):
    """Image ids (multi_modal_uuids) stand in for vLLM's pixel hash: content ids give the outputs of no ids, and
    one id given to two different pictures makes vLLM reuse the first one's features, which shows it trusts them."""
    import uuid

    vllm_engine.load_lora(random_adapter(vllm_engine.spec), 10)
    greedy = Sampling(max_new_tokens=8, temperature=0.0)
    plain = vllm_engine.generate(prompts, greedy)
    vllm_engine.llm.reset_prefix_cache()
    named = [Prompt(p.token_ids, p.images, [f"content-{uuid.uuid4()}"]) for p in prompts]
    assert_same_generations(plain, vllm_engine.generate(named, greedy))
    # prompts 0 and 2: two mazes drawn at the same scale, so the same token ids around different pictures
    first, other = prompts[0], prompts[2]
    assert first.token_ids == other.token_ids and first.images[0].tobytes() != other.images[0].tobytes()
    shared = f"shared-{uuid.uuid4()}"
    vllm_engine.llm.reset_prefix_cache()
    lied = vllm_engine.generate(
        [Prompt(first.token_ids, first.images, [shared]), Prompt(other.token_ids, other.images, [shared])], greedy
    )
    assert plain[0].logprobs != plain[2].logprobs  # the pictures matter to the model...
    assert lied[1].logprobs == lied[0].logprobs == plain[0].logprobs  # ...and the id alone picked the features
    with pytest.raises(ValueError, match="image ids"):
        vllm_engine.generate([Prompt(first.token_ids, first.images, ["a", "b"])], greedy)


def test_named_pictures_reach_vllm_as_arrays_made_once(vllm_engine, prompts, monkeypatch):
    """A named picture is handed to vLLM as its RGB pixels, one array per content id however many requests show it;
    the arrays' bytes held are bounded, the oldest used going first (prompts without ids keep their PIL pictures)."""
    import numpy as np

    from app.rollout.engines import vllm as vllm_module

    picture = prompts[0].images[0]
    monkeypatch.setattr(vllm_module, "_ARRAYS_BYTES", 2 * np.asarray(picture.convert("RGB")).nbytes)  # two held
    monkeypatch.setattr(vllm_engine, "_arrays", {})
    monkeypatch.setattr(vllm_engine, "_array_bytes", 0)
    named = Prompt(prompts[0].token_ids, prompts[0].images, ["a"])
    first, again = (vllm_engine._request(named, 0)["multi_modal_data"]["image"][0] for _ in range(2))
    assert first is again and np.array_equal(first, np.asarray(picture.convert("RGB")))
    for key in ("b", "a", "c"):  # "a" used again after "b": "b" is the oldest used when "c" comes
        vllm_engine._request(Prompt(named.token_ids, named.images, [key]), 0)
    assert list(vllm_engine._arrays) == ["a", "c"]
    assert vllm_engine._array_bytes == sum(a.nbytes for a in vllm_engine._arrays.values())
    assert vllm_engine._request(prompts[0], 0)["multi_modal_data"]["image"][0] is picture


@pytest.fixture(scope="module")
def image_loving_model(tmp_path_factory, tiny_model_dir):
    """The tiny model with its output layer biased hard towards the vision special tokens."""
    import shutil

    from app.model.load import load_model, load_processor

    out = tmp_path_factory.mktemp("image-loving")
    model = load_model(tiny_model_dir)
    tok = load_processor(tiny_model_dir).tokenizer
    with torch.no_grad():
        for t in VISION_TOKENS:
            model.lm_head.weight[tok.convert_tokens_to_ids(t)] *= 200.0
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja"):
        shutil.copy(f"{tiny_model_dir}/{f}", out / f)
    return str(out)


def test_vision_tokens_are_never_sampled(image_loving_model, tiny_lora, codec, prompts):
    from app.rollout.engines.hf import HFEngine

    engine = HFEngine(image_loving_model, tiny_lora)
    forbidden = set(codec.forbidden_ids())
    base = load_unmasked_argmax(engine, prompts[0])
    assert base in forbidden  # without the mask, the model would emit a vision token
    for temperature in (0.0, 1.0):
        for gen in engine.generate(prompts, Sampling(max_new_tokens=12, temperature=temperature, seed=0)):
            assert not forbidden & set(gen.token_ids)
            assert all(lp > float("-inf") for lp in gen.logprobs)


def test_vllm_never_samples_vision_tokens(image_loving_model, tiny_lora, codec, prompts):
    """The batched mask (vllm_logits.ForbidVisionTokens) and vLLM's per-request bad words forbid the same
    tokens at the same point: equal greedy replies and logprobs, and no vision token sampled either way."""
    from app.rollout.engines.vllm import VLLMEngine

    forbidden, greedy = set(codec.forbidden_ids()), {}
    for way in ("logits_processor", "bad_words"):
        engine = VLLMEngine(image_loving_model, tiny_lora, max_model_len=2048, max_images=4, forbid_with=way)
        try:
            for temperature in (0.0, 1.0):
                gens = engine.generate(prompts, Sampling(max_new_tokens=12, temperature=temperature, seed=0))
                for gen in gens:
                    assert not forbidden & set(gen.token_ids)
                if temperature == 0.0:
                    greedy[way] = gens
        finally:
            engine.shutdown()
    assert_same_generations(greedy["logits_processor"], greedy["bad_words"], tol=1e-5)


def test_vllm_requests_carry_the_vision_tokens_as_vllm_tokenizes_them(vllm_engine):
    """The engine tokenizes the vision tokens once; each request carries the ids vLLM would compute from the strings
    for it, and vLLM's per-request tokenizing finds no strings to redo."""
    from vllm import SamplingParams

    params = vllm_engine._params(Sampling(max_new_tokens=4), seed=None)
    plain = SamplingParams(bad_words=list(VISION_TOKENS))
    plain.update_from_tokenizer(vllm_engine.llm.get_tokenizer())
    params.update_from_tokenizer(vllm_engine.llm.get_tokenizer())  # as vLLM's input processor calls it
    assert params.bad_words_token_ids == plain.bad_words_token_ids
    assert len(plain.bad_words_token_ids) >= len(VISION_TOKENS)


def load_unmasked_argmax(engine, prompt) -> int:
    t = torch.tensor([prompt.token_ids])
    inputs = {
        "input_ids": t,
        "attention_mask": torch.ones_like(t),
        "mm_token_type_ids": engine.codec.mm_token_type_ids(t),
        **engine.codec.vision_inputs(prompt.images),
    }
    with torch.no_grad():
        return int(engine.model(**inputs).logits[0, -1].argmax())


def test_engine_stats_and_versions(hf_engine, vllm_engine):
    for engine in (hf_engine, vllm_engine):
        stats = engine.stats()
        assert stats["lora_version"] == engine.lora_version
        assert stats["generate_calls"] > 0 and stats["generated_tokens"] > 0


def test_processes_that_make_no_transformers_engine_start_without_peft_or_vllm():
    """The evaluator and a rollout actor import their modules at every start: PEFT comes only with the transformers
    engine and vLLM only with the vLLM engine, when make_engine makes one."""
    probe = (
        "import sys, actors.evaluator, actors.rollout; print(sorted(m for m in ('peft', 'vllm') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
