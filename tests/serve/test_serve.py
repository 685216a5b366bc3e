"""The serving app (app/serve/deployment.py) on a real Ray Serve over loopback, adapters on a real S3 server.

One Serve instance for the module on the session's Ray cluster, with two applications: the server under
test at `/` (bearer token on, adapters under an S3 prefix, small limits so the refusals are cheap to reach)
and one at `/dead` whose S3 endpoint is a closed port. Clients are the `openai` package and httpx. Serve is
shut down at the end of the module.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import uuid

import httpx
import openai
import pytest
import torch

from app.config import LoraSettings
from app.model.adapters import AdapterSpec
from app.serve.adapters import AdapterRegistry, InvalidAdapterName, check_name, complete_adapters
from app.serve.api import ServeSettings, encode_conversation, parse_chat_request, token_digest
from app.serve.client import Reply, ServedEpisode
from app.world.rules import EpisodeSettings
from tests.s3_server import S3Endpoint, free_port, missing_ceph_binaries

pytestmark = pytest.mark.timeout(900)

TOKEN = f"token-{uuid.uuid4().hex}"
ENGINE_LORA = LoraSettings(rank=8, alpha=16)
PLAY = EpisodeSettings(max_turns=6, maze_size=5, cell_px=32, image_history=2, feedback="compass", max_new_tokens=12)
A, B, LATE = "global_step_000001", "runB/global_step_000002", "global_step_000003"
LIMITS = dict(
    max_images=4,
    max_image_pixels=256 * 256,
    max_body_bytes=2 << 20,
    max_model_len=2048,
    max_tokens_cap=64,
    max_cached_adapters=2,
)


def random_adapter(text_config, lora: LoraSettings, seed: int) -> tuple[dict[str, torch.Tensor], AdapterSpec]:
    spec = AdapterSpec.for_model(text_config, lora)
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * 0.3 for name, shape in spec.shapes.items()}, spec


def export(store_uri: str, endpoint: S3Endpoint, step: int, tensors, spec) -> None:
    from app.storage.checkpoint import export_adapter
    from app.storage.s3 import S3Store

    export_adapter(S3Store(store_uri, endpoint_url=endpoint.endpoint_url), step, tensors, spec.peft_config())


def png(width: int, height: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (255, 255, 255)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def s3(request) -> S3Endpoint:
    """The real S3 server (Ceph RGW) where it is installed, else moto's emulator."""
    return request.getfixturevalue("moto_s3" if missing_ceph_binaries() else "ceph_s3")


@pytest.fixture(scope="module")
def text_config(tiny_model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model_dir).text_config


@pytest.fixture(scope="module")
def adapters(s3, text_config):
    """Two adapters under s3://<bucket>/export before the start: one of the engine's shape, and one of rank 4
    and another scale, nested one folder deeper (the server pads and rescales it)."""
    bucket = s3.new_bucket("mazerl-serve")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env().items():
            mp.setenv(key, value)
        made = {
            A: random_adapter(text_config, ENGINE_LORA, 1),
            B: random_adapter(text_config, LoraSettings(rank=4, alpha=4), 2),
        }
        export(f"s3://{bucket}/export", s3, 1, *made[A])
        export(f"s3://{bucket}/export/runB", s3, 2, *made[B])
    return f"s3://{bucket}/export", made


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_model_dir, adapters, s3):
    from ray import serve

    from app.serve.deployment import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    live = ServeSettings(
        model_path=tiny_model_dir,
        adapters_root=adapters[0],
        s3_endpoint_url=s3.endpoint_url,
        lora_rank=8,
        lora_alpha=16,
        token_sha256=token_digest(TOKEN),
        **LIMITS,
    )
    dead = ServeSettings(
        model_path=tiny_model_dir,
        adapters_root="s3://mazerl-dead/export",
        lora_rank=8,
        lora_alpha=16,
        s3_endpoint_url=f"http://127.0.0.1:{free_port()}",
        s3_max_attempts=1,
        s3_connect_timeout=1.0,
    )
    started = time.monotonic()
    serve.run_many(
        [
            serve.RunTarget(build_app(live, num_cpus=0.5, env_vars=s3.env()), name="mazerl-test", route_prefix="/"),
            serve.RunTarget(
                build_app(dead, num_cpus=0.25, env_vars=s3.env()), name="mazerl-dead", route_prefix="/dead"
            ),
        ]
    )
    print(f"\nServe up with two apps in {time.monotonic() - started:.1f} s")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference_engine(tiny_model_dir):
    from app.rollout.engines.hf import HFEngine

    return HFEngine(tiny_model_dir, ENGINE_LORA)


def maze_messages(seed: int = 3) -> list[dict]:
    from app.world.maze import generate_maze

    return ServedEpisode(generate_maze(seed, PLAY.maze_size), PLAY).messages()


def ask(client, model: str, messages=None, **extra) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=model,
        messages=messages or maze_messages(),
        temperature=0,
        max_tokens=PLAY.max_new_tokens,
        extra_body={"return_token_ids": True},
        **extra,
    )


def stats(server) -> dict:
    return httpx.get(f"{server}/v1/debug/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()


# ---------------------------------------------------------------- no server needed


def test_plain_adapter_names_only():
    for good in ("global_step_000020", "run-1/global_step_000020", "v1.2_final"):
        assert check_name(good) == good
    for bad in (
        "",
        "..",
        "../x",
        "a/../../b",
        "/etc/passwd",
        "s3://bucket/x",
        "http://evil/x",
        "a/b/c",
        "%2e%2e",
        "a\\b",
        ".hidden",
        "a b",
        "x" * 300,
        "a//b",
    ):
        with pytest.raises(InvalidAdapterName):
            check_name(bad)
    keys = [
        "global_step_000001/adapter_config.json",
        "global_step_000001/adapter_model.safetensors",
        "global_step_000001/MANIFEST.json",
        "global_step_000002/adapter_config.json",
        "global_step_000002/adapter_model.safetensors",  # no manifest yet: still being written
        "plain/adapter_config.json",
        "plain/adapter_model.safetensors",
        "latest",
        ".tmp-x/adapter_config.json",
        ".tmp-x/adapter_model.safetensors",
    ]
    assert complete_adapters(keys) == ["global_step_000001", "plain"]


def test_served_context_is_the_rollout_context_token_for_token(codec, tiny_model_dir):
    """play.py's messages, parsed and encoded by the server, are the ids RunningEpisode.prompt() gives, turn by
    turn: image window, compass text, canonical replies, arbitrary sampled ids and replies cut at max_tokens."""
    import random

    from app.rollout.episodes import EpisodeRequest, RunningEpisode
    from app.world.maze import generate_maze
    from app.world.rules import EpisodeSettings

    rng = random.Random(0)
    allowed = sorted(set(range(len(codec.tokenizer))) - set(codec.forbidden_ids()) - {codec.im_end_id})
    settings = ServeSettings(model_path=tiny_model_dir, adapters_root="/unused")
    for window, feedback, turns in (
        (0, "visgym", 0),
        (2, "compass", 0),
        (1, "visgym", 0),
        (1, "visgym", 1),
        (0, "compass", 2),
    ):
        play = EpisodeSettings(
            max_turns=7, maze_size=7, cell_px=32, image_history=window, feedback=feedback, turn_history=turns
        )
        maze = generate_maze(3, 7)
        rollout = RunningEpisode(
            EpisodeRequest(maze), codec, EpisodeSettings(7, 7, 32, window, feedback=feedback, turn_history=turns)
        )
        served = ServedEpisode(maze, play)
        for turn in range(7):
            ids, images = encode_conversation(
                codec, parse_chat_request({"model": "base", "messages": served.messages()}, settings).messages
            )
            prompt = rollout.prompt()
            assert ids == prompt.token_ids, (window, feedback, turn)
            assert [i.tobytes() for i in images] == [i.tobytes() for i in prompt.images]
            if turn % 3 == 0:
                sampled = codec.tokenizer.encode(f"('move', {rng.randrange(4)})", add_special_tokens=False) + [
                    codec.im_end_id
                ]
            else:
                sampled = [rng.choice(allowed) for _ in range(8)] + ([codec.im_end_id] if turn % 3 == 1 else [])
            rollout.advance(sampled, [0.0] * len(sampled), "stop")
            served.advance(Reply(codec.decode(sampled), sampled))
            if rollout.env.done:
                break


def test_registry_on_a_local_export_dir(tmp_path, text_config):
    from app.model.adapters import ADAPTER_WEIGHTS
    from app.serve.adapters import AdapterUnusable, UnknownAdapter, fit_to_spec
    from app.storage.checkpoint import export_adapter
    from app.storage.local import LocalStore

    engine_spec = AdapterSpec.for_model(text_config, ENGINE_LORA)
    small, small_spec = random_adapter(text_config, LoraSettings(rank=4, alpha=4), 5)
    export_adapter(str(tmp_path), 7, small, small_spec.peft_config())
    registry = AdapterRegistry(LocalStore(tmp_path), text_config, engine_spec, max_cached=1)
    assert registry.available() == ["global_step_000007"]
    fitted = registry.get("global_step_000007")
    assert {k: tuple(v.shape) for k, v in fitted.items()} == engine_spec.shapes
    name = next(iter(small))  # the same function: padded rank, B rescaled by (4/4) / (16/8)
    if name.endswith("lora_A.weight"):
        name = name.replace("lora_A", "lora_B")
    assert torch.equal(fitted[name][:, :4], small[name] * 0.5) and not fitted[name][:, 4:].any()
    assert fitted is registry.get("global_step_000007") and registry.stats()["downloads"] == {"global_step_000007": 1}
    with pytest.raises(UnknownAdapter) as unknown:
        registry.get("global_step_000008")
    assert unknown.value.available == ["global_step_000007"]
    (tmp_path / "global_step_000007" / ADAPTER_WEIGHTS).write_bytes(b"not safetensors")  # corrupt after the fact
    export_adapter(str(tmp_path), 9, small, small_spec.peft_config())
    registry.get("global_step_000009")  # evicts 7 (max_cached=1)
    with pytest.raises(AdapterUnusable, match="MANIFEST"):
        registry.get("global_step_000007")
    assert fit_to_spec(fitted, engine_spec, engine_spec) is fitted


# ---------------------------------------------------------------- the served API


def test_models_lists_base_and_every_adapter(client):
    assert [m.id for m in client.models.list().data] == ["base", A, B]


def test_base_and_two_adapters_answer_differently_and_as_the_engine_does(
    client, adapters, reference_engine, codec, tiny_model_dir
):
    from app.rollout.engines.base import Prompt, Sampling
    from app.rollout.engines.hf import HFEngine

    _, made = adapters
    chat = parse_chat_request({"model": "base", "messages": maze_messages()}, ServeSettings("m", "r"))
    prompt = Prompt(*encode_conversation(codec, chat.messages))
    answers = {}
    for model in ("base", A, B):
        completion = ask(client, model)
        answers[model] = completion.choices[0].token_ids
        assert completion.usage.prompt_tokens == len(prompt.token_ids)
        assert completion.choices[0].message.content == codec.decode(answers[model])
    assert len({tuple(v) for v in answers.values()}) == 3, answers
    # the ids the engine gives locally: base = all-zero LoRA; A as it is; B (rank 4, alpha 4) at its own shape,
    # which the server padded to rank 8 and rescaled
    zeros = {k: torch.zeros(s) for k, s in reference_engine.spec.shapes.items()}
    for model, engine, tensors in (
        ("base", reference_engine, zeros),
        (A, reference_engine, made[A][0]),
        (B, HFEngine(tiny_model_dir, LoraSettings(rank=4, alpha=4)), made[B][0]),
    ):
        engine.load_lora(tensors, 1)
        assert answers[model] == engine.generate([prompt], Sampling(PLAY.max_new_tokens, 0.0))[0].token_ids, model


def test_adapter_uploaded_after_the_start_is_found(client, adapters, s3, text_config, server):
    root, _ = adapters
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3.env().items():
            mp.setenv(key, value)
        export(root, s3, 3, *random_adapter(text_config, ENGINE_LORA, 3))
    assert LATE in [m.id for m in client.models.list().data]
    assert ask(client, LATE).choices[0].finish_reason in ("stop", "length")
    assert ask(client, "base:" + LATE).choices[0].token_ids  # ray.serve.llm's spelling


def test_second_request_for_an_adapter_does_not_download_it_again(client, server):
    ask(client, A)
    before = stats(server)["registry"]
    ask(client, A)
    ask(client, "base")
    ask(client, A)
    after = stats(server)["registry"]
    assert after["downloads"][A] == before["downloads"][A] >= 1
    assert after["storage_reads"] == before["storage_reads"]
    assert after["cache_hits"] >= before["cache_hits"] + 2


def test_cache_is_a_bounded_lru(client, server):
    for model in (A, B, LATE, A):
        ask(client, model)
    registry = stats(server)["registry"]
    assert len(registry["cached"]) == LIMITS["max_cached_adapters"] and registry["cached"][-1] == A
    assert registry["evictions"] >= 1


def test_bearer_token_is_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = httpx.get(f"{server}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_unknown_adapter_is_404_listing_the_available_ones(client):
    with pytest.raises(openai.NotFoundError) as e:
        ask(client, "global_step_999999")
    assert e.value.status_code == 404
    assert set(e.value.body["available"]) >= {A, B} and A in e.value.message


@pytest.mark.parametrize(
    "name",
    [
        "../global_step_000001",
        "s3://other-bucket/x",
        "http://127.0.0.1:1/x",
        "/etc/passwd",
        "a/b/c",
        "%2e%2e%2fsecret",
        "run/../../x",
        "global_step_1\n",
    ],
)
def test_names_that_are_not_plain_names_are_400(client, name):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, name)
    assert e.value.body["code"] == "invalid_model_name"


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_bad_images_and_too_many_tokens_are_400(client):
    ok = png(64, 64)
    cases = {
        "invalid_image": [
            _user(_image("data:image/png;base64,@@@not-base64@@@")),
            _user(_image("data:image/png;base64," + base64.b64encode(b"GIF89a-truncated").decode())),
            _user(_image("https://example.com/maze.png")),
            _user(_image("file:///etc/passwd")),
            _user(_image(png(250, 1))),
        ],  # an aspect ratio the image processor refuses
        "image_too_large": [_user(_image(png(300, 300)))],
        "too_many_images": [_user(*[_image(ok)] * (LIMITS["max_images"] + 1))],
        "context_length_exceeded": [_user({"type": "text", "text": "move " * 3000})],
    }
    for code, message_lists in cases.items():
        for messages in message_lists:
            with pytest.raises(openai.BadRequestError) as e:
                ask(client, "base", messages)
            assert e.value.body["code"] == code, (code, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="base", messages=_user(_image(ok)), max_tokens=10_000)
    assert e.value.body["code"] == "max_tokens_too_large"
    with pytest.raises(openai.BadRequestError):
        ask(client, "base", _user({"type": "text", "text": "<|image_pad|>" * 5}))
    codec_replies = [{"role": "assistant", "content": "('move', 0)", "token_ids": [1, 2, 3]}]
    with pytest.raises(openai.BadRequestError) as e:  # ids that are not the reply's
        ask(client, "base", _user(_image(ok)) + codec_replies + _user({"type": "text", "text": "next?"}))
    assert e.value.body["code"] == "invalid_token_ids"


def test_malformed_and_oversized_bodies(server):
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    url = f"{server}/v1/chat/completions"
    assert httpx.post(url, content=b"{not json", headers=headers).status_code == 400
    assert httpx.post(url, content=b"[1, 2]", headers=headers).status_code == 400
    assert httpx.post(url, json={"model": "base"}, headers=headers).status_code == 400
    r = httpx.post(
        url, json={"model": "base", "messages": _user({"type": "text", "text": "x" * (3 << 20)})}, headers=headers
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(
        url, json={"model": "base", "messages": _user({"type": "text", "text": "hi"}), "stream": True}, headers=headers
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"


def test_storage_unreachable_is_503_with_the_reason_and_the_base_model_still_answers(server):
    dead = openai.OpenAI(base_url=f"{server}/dead/v1", api_key="none", max_retries=0, timeout=60)
    for call in (lambda: dead.models.list(), lambda: ask(dead, A)):
        with pytest.raises(openai.InternalServerError) as e:
            call()
        assert e.value.status_code == 503 and e.value.body["reason"] == "endpoint unreachable"
        assert "mazerl-dead" in e.value.message
    assert ask(dead, "base").choices[0].token_ids


def test_concurrent_load_on_loopback_completes_without_errors(server, client):
    """48 requests, 16 at a time, over base and three adapters, after every bad request above: all answer."""
    models = ["base", A, B, LATE]
    messages = maze_messages()

    async def run() -> list[float]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=TOKEN, max_retries=0, timeout=300) as aclient:
            gate = asyncio.Semaphore(16)

            async def one(i: int) -> float:
                async with gate:
                    start = time.perf_counter()
                    completion = await aclient.chat.completions.create(
                        model=models[i % len(models)], messages=messages, temperature=0, max_tokens=PLAY.max_new_tokens
                    )
                    assert completion.choices[0].finish_reason in ("stop", "length")
                    return time.perf_counter() - start

            return await asyncio.gather(*(one(i) for i in range(48)))

    started = time.perf_counter()
    latencies = sorted(asyncio.run(run()))
    wall = time.perf_counter() - started
    figures = {
        "requests": 48,
        "concurrency": 16,
        "wall_s": round(wall, 2),
        "req_per_s": round(48 / wall, 2),
        "p50_s": round(latencies[24], 3),
        "p95_s": round(latencies[45], 3),
        "max_s": round(latencies[-1], 3),
    }
    print(f"\nload test: {json.dumps(figures)}")
    after = stats(server)
    assert after["responses"].get("500", 0) == 0
    assert httpx.get(f"{server}/health").status_code == 200
