"""OpenAI-compatible serving of the base model and every adapter under a root, as a Ray Serve application.

Start it (one command; Ctrl-C stops it; it starts a local Ray unless --address names a cluster):

    python -m app.serve --model PATH_OR_tiny [--adapters s3://bucket/prefix/export|DIR] \\
        [--engine hf|vllm|serve-llm] [--host 127.0.0.1] [--port 8000] [--token-env VAR] \\
        [--s3-endpoint-url URL] [--max-cached-adapters 4] [--lora-rank R --lora-alpha A] [--address auto]

then play mazes through it: `python scripts/play.py --base-url http://127.0.0.1:8000/v1 --model global_step_000020`.

The API (OpenAI's schema; every error is `{"error": {"message", "type", "code"}}`):

    GET  /v1/models             `base` and every complete adapter under the root, listed at request time
                                (an adapter uploaded after the start is found); without --adapters, `base`
                                alone. An every-weight export (modules_to_save [language_model]) is not listed:
                                it is a whole model, served merged (scripts/merge_adapter.py) as --model
    POST /v1/chat/completions   model: `base` or an adapter name (`global_step_000020`, `run/global_step_000020`;
                                `base:<adapter>`, the name ray.serve.llm uses, is accepted too); messages as
                                app.world.dialogue writes them, images as `image_url` parts with base64 data URLs
                                (the server fetches no URL); temperature (default 1, 0 = greedy), top_p,
                                max_tokens / max_completion_tokens, seed, return_token_ids. n = 1, no streaming.
    GET  /v1/debug/stats        storage reads and listings, adapter downloads, cache, engine counters
    GET  /health                liveness, no auth and no storage access

Statuses: 400 bad input (not a plain adapter name, malformed/oversized/too many images, prompt + max_tokens
over the context length, max_tokens over the cap, unsupported parameters); 401 missing or wrong bearer token
(when --token-env names a variable: the token is read from it at start, and only its sha256 reaches the
replicas); 404 unknown model (the body lists the available ones); 413 request body over the limit; 422 the
adapter exists but is corrupt or does not fit the base model; 503 storage unreachable (with the reason).
No bad request takes the replica down.

How a request becomes tokens: the conversation is rendered in Qwen's ChatML exactly as app.rollout.encoding.ChatCodec
builds a rollout's context (app/serve/api.py), so a conversation played through the server is token for token
the one training plays. Generated text is never re-tokenized when the client asks for `return_token_ids: true`
(the reply's ids come back in `choices[0].token_ids`, vLLM's name) and sends them back as the assistant
message's `token_ids` (checked: they must decode to its content); other clients' replies are re-tokenized.
Vision tokens are never sampled. Each replica runs one engine (app.rollout.engines: hf or vllm) on its own thread,
one request at a time, holding one adapter that is swapped when a request names another model (with its trained
vision tower when it carries one: lora.modules_to_save [visual]); adapter tensors come from the replica's LRU
cache (app.serve.adapters), downloaded once per adapter (app/serve/service.py).
On GPU, `--engine serve-llm` builds Ray Serve's LLM app instead (vLLM's OpenAI server with dynamic LoRA loading
from the s3:// root), see `build_serve_llm_app`; vLLM's own LoRA loading takes no whole modules, so that app serves
LoRA-only adapters, and adapters that carry a vision tower are served by the hf and vllm engines.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

import ray
import torch
from fastapi import FastAPI, Request
from ray import serve

from app.config import ModelConfig
from app.model.build import ensure_model
from app.serve.api import ServeSettings, token_digest
from app.serve.service import MazeService

log = logging.getLogger("mazerl.serve")

APP_NAME = "mazerl"


# ---------------------------------------------------------------- the Ray Serve deployment

api = FastAPI(title="mazerl", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(name="MazeServer", max_ongoing_requests=64)
@serve.ingress(api)
class MazeServer:
    def __init__(self, settings: ServeSettings):
        self.service = MazeService(settings)

    @api.get("/health")
    async def health(self, request: Request):
        return {"status": "ok"}  # no auth here, so nothing about what is served

    @api.get("/v1/models")
    async def models(self, request: Request):
        return await self.service.answer(request, self.service.models)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.service.answer(request, self.service.chat)

    @api.get("/v1/debug/stats")
    async def stats(self, request: Request):
        return await self.service.answer(request, self.service.stats)

    def debug_stats(self) -> dict:
        """The same as /v1/debug/stats, for a Serve handle (`handle.debug_stats.remote()`)."""
        return self.service.stats_dict()

    def __del__(self):
        service = getattr(self, "service", None)
        if service is not None:
            try:
                service.shutdown()
            except Exception:  # noqa: BLE001 - best effort at replica teardown
                pass


def build_app(
    settings: ServeSettings,
    *,
    num_replicas: int = 1,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    env_vars: dict[str, str] | None = None,
):
    """The Ray Serve application (bind it with serve.run). env_vars reach the replicas through Ray's runtime
    env (visible in Ray's metadata: use it for endpoints, not for secrets you can provide otherwise)."""
    options: dict = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if env_vars:
        options["runtime_env"] = {"env_vars": dict(env_vars)}
    return MazeServer.options(num_replicas=num_replicas, ray_actor_options=options).bind(settings)


def build_serve_llm_app(settings: ServeSettings, *, num_replicas: int = 1, max_lora_rank: int = 64):
    """GPU: Ray Serve's LLM library (vLLM's OpenAI server) with dynamic LoRA loading from the s3:// root.

    Model ids there are `base` and `base:<adapter folder>` (this app accepts those too). Differences from the
    app above: no bearer-token auth (put it behind a gateway), the server re-renders the conversation with the
    model's chat template, and vision tokens are forbidden only when the client sends
    `bad_words` (scripts/play.py does). Needs the GPU stack: ray.serve.llm does not import in the CPU venv (no
    pyarrow)."""
    from ray.serve.llm import LLMConfig, build_openai_app  # lazy: GPU stack only (no pyarrow in the CPU venv)

    root = settings.adapters_root
    if root is not None and not root.startswith("s3://"):
        raise ValueError("ray.serve.llm loads adapters from cloud storage only: --adapters must be s3://...")
    engine_kwargs = {
        "dtype": settings.dtype,
        "max_model_len": settings.max_model_len,
        "limit_mm_per_prompt": {"image": settings.max_images},
        "enforce_eager": True,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
    }
    lora_config = None
    if root is not None:  # without a root the model alone is served (a merged model, say)
        engine_kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=settings.max_cached_adapters)
        lora_config = {
            "dynamic_lora_loading_path": root.rstrip("/"),
            "max_num_adapters_per_replica": settings.max_cached_adapters,
        }
    config = LLMConfig(
        model_loading_config={"model_id": settings.base_name, "model_source": settings.model_path},
        lora_config=lora_config,
        engine_kwargs=engine_kwargs,
        deployment_config={"num_replicas": num_replicas},
        runtime_env={"env_vars": {"AWS_ENDPOINT_URL": settings.s3_endpoint_url}} if settings.s3_endpoint_url else None,
    )
    return build_openai_app({"llm_configs": [config]})


# ---------------------------------------------------------------- the command


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m app.serve",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="local folder of the base model (HF format), or 'tiny'")
    p.add_argument(
        "--adapters", help="adapters root: s3://bucket/prefix or a local directory (none: the model alone is served)"
    )
    p.add_argument("--engine", choices=("hf", "vllm", "serve-llm"), default="hf")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (0.0.0.0 to expose it)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--token-env", help="name of the environment variable holding the bearer token (auth on)")
    p.add_argument("--s3-endpoint-url", help="endpoint of an S3-compatible store (default: AWS)")
    p.add_argument("--base-name", default="base", help="the model name of the base model")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--lora-rank", type=int, help="engine LoRA rank (default: the newest adapter's)")
    p.add_argument("--lora-alpha", type=int, help="engine LoRA alpha (default: the newest adapter's)")
    p.add_argument("--lora-targets", help="comma-separated engine LoRA modules (default: the newest adapter's)")
    p.add_argument("--max-cached-adapters", type=int, default=4)
    p.add_argument("--max-images", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-tokens-cap", type=int, default=1024)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--num-gpus", type=float, default=None, help="GPUs per replica (default: 1 when CUDA is there)")
    p.add_argument(
        "--forward-env",
        action="append",
        default=[],
        help="copy this variable from here to the replicas (repeatable; e.g. AWS_PROFILE)",
    )
    p.add_argument(
        "--model-cache", default=os.path.expanduser("~/.cache/mazerl/models"), help="where --model tiny is built"
    )
    p.add_argument("--address", default=None, help="Ray cluster to join ('auto'); default: start a local one")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    model = args.model
    if model == "tiny":
        model = str(ensure_model(ModelConfig(), args.model_cache))
    elif not Path(model).is_dir():
        raise SystemExit(f"--model {model}: no such folder")
    token_sha256 = None
    if args.token_env:
        token = os.environ.get(args.token_env, "")
        if not token:
            raise SystemExit(f"--token-env {args.token_env}: the variable is not set or empty")
        token_sha256 = token_digest(token)
    adapters = args.adapters
    if adapters and not adapters.startswith("s3://"):
        adapters = str(Path(adapters).expanduser().resolve())
    return ServeSettings(
        model_path=str(Path(model).resolve()),
        adapters_root=adapters,
        s3_endpoint_url=args.s3_endpoint_url,
        engine="vllm" if args.engine == "serve-llm" else args.engine,
        base_name=args.base_name,
        dtype=args.dtype,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_targets=tuple(args.lora_targets.split(",")) if args.lora_targets else None,
        max_cached_adapters=args.max_cached_adapters,
        max_images=args.max_images,
        max_model_len=args.max_model_len,
        max_tokens_cap=args.max_tokens_cap,
        token_sha256=token_sha256,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    settings = settings_from_args(args)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # "local", not None, without --address: None joins the cluster named in /tmp/ray/ray_current_cluster, and
    # waits on it without a word when that cluster is gone
    ray.init(address=args.address or "local", namespace="mazerl-serve")
    if args.engine == "serve-llm":
        app = build_serve_llm_app(settings, num_replicas=args.replicas)
    else:
        gpus = args.num_gpus if args.num_gpus is not None else (1.0 if torch.cuda.is_available() else 0.0)
        env = {name: os.environ[name] for name in args.forward_env if name in os.environ}
        app = build_app(settings, num_replicas=args.replicas, num_gpus=gpus, env_vars=env)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name=APP_NAME, route_prefix="/")
    print(f"mazerl serving on http://{args.host}:{args.port}/v1 (models: GET /v1/models); Ctrl-C stops", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0
