"""The serving app's HTTP contract: settings, OpenAI-shaped errors, request checking and the prompt encoding.

Everything here is plain Python (no Ray, no engine), so every rule about bad input is one function to read
and to test: `parse_chat_request` turns an OpenAI chat-completions body into checked messages with decoded
images, `encode_conversation` turns those into the token ids a rollout would have had, and every refusal
is an `ApiError` (status, OpenAI error body). See app/serve/deployment.py for the API as a whole.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse
from PIL import Image

from app.model.load import VISION_TOKENS
from app.serve.adapters import AdapterUnusable, InvalidAdapterName, UnknownAdapter, check_name
from app.storage.store import StorageUnavailable

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
ROLES = ("system", "user", "assistant")
VISION_MARKERS = tuple(VISION_TOKENS)
UNSUPPORTED = ("tools", "functions", "tool_choice", "response_format", "logit_bias", "stop", "audio")


@dataclass(frozen=True)
class ServeSettings:
    """Everything a replica needs; plain values, so Ray can ship it. The token travels only as its sha256."""

    model_path: str
    adapters_root: str | None = None  # None: the base model alone (a merged model, say)
    s3_endpoint_url: str | None = None
    engine: str = "hf"  # hf or vllm (serve-llm is a different app, see build_serve_llm_app)
    base_name: str = "base"
    dtype: str = "float32"
    lora_rank: int | None = None  # the engine's LoRA shape; None: the newest adapter's at start, else defaults
    lora_alpha: int | None = None
    lora_targets: tuple[str, ...] | None = None
    max_cached_adapters: int = 4  # adapter tensors kept per replica (LRU)
    max_images: int = 32  # per request
    max_image_bytes: int = 8 << 20  # decoded bytes of one image
    max_image_pixels: int = 2048 * 2048  # width x height of one image
    max_body_bytes: int = 64 << 20  # the whole request body (413 above it)
    max_model_len: int = 4096  # prompt + max_tokens
    max_tokens_cap: int = 1024  # the largest max_tokens a request may ask for
    default_max_tokens: int = 256  # when a request gives none (clipped to the context left)
    token_sha256: str | None = None  # bearer-token auth when set
    s3_max_attempts: int = 2  # an unreachable store answers 503 within seconds, not minutes
    s3_connect_timeout: float = 3.0
    gpu_memory_utilization: float = 0.45

    def __post_init__(self) -> None:
        if self.engine not in ("hf", "vllm"):
            raise ValueError(f"engine must be 'hf' or 'vllm' for this app, got {self.engine!r}")
        for name in (
            "max_cached_adapters",
            "max_images",
            "max_image_bytes",
            "max_image_pixels",
            "max_body_bytes",
            "max_model_len",
            "max_tokens_cap",
            "default_max_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_name(self.base_name)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# ---------------------------------------------------------------- errors


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        extra: dict | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.extra, self.headers = extra or {}, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "code": self.code, **self.extra}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code=code)


def as_api_error(error: BaseException) -> ApiError:
    """The HTTP answer for any failure of a request; only an unexpected error is a 500."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, InvalidAdapterName):
        return ApiError(400, str(error), code="invalid_model_name")
    if isinstance(error, UnknownAdapter):
        return ApiError(
            404,
            f"the model {error.name!r} does not exist ({error.why}); available: {', '.join(error.available) or 'none'}",
            code="model_not_found",
            extra={"available": error.available},
        )
    if isinstance(error, AdapterUnusable):
        return ApiError(422, f"the adapter cannot be served: {error}", code="adapter_unusable")
    if isinstance(error, StorageUnavailable):
        return ApiError(
            503,
            f"adapter storage unavailable: {error.reason} ({error.where})",
            kind="server_error",
            code="storage_unavailable",
            extra={"reason": error.reason},
        )
    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
        return ApiError(
            503,
            f"adapter storage unavailable: {type(error).__name__}: {error}",
            kind="server_error",
            code="storage_unavailable",
            extra={"reason": "storage error"},
        )
    return ApiError(500, f"internal error: {type(error).__name__}", kind="server_error", code="internal_error")


# ---------------------------------------------------------------- request parsing


@dataclass
class Message:
    role: str
    parts: list  # a part is a str or a PIL image
    token_ids: list[int] | None = None  # an assistant reply's ids as the server sampled them (return_token_ids)


@dataclass
class ChatRequest:
    model: str
    messages: list[Message] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    seed: int | None = None
    return_token_ids: bool = False
    image_count: int = 0


def _number(body: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise bad_request(f"{key} must be a number")
    if value > high or value < low or (low_open and value == low):
        raise bad_request(f"{key} must be in {'(' if low_open else '['}{low}, {high}], got {value}")
    return float(value)


def _integer(body: dict, key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{key} must be an integer")
    if not low <= value <= high:
        code = "max_tokens_too_large" if key in ("max_tokens", "max_completion_tokens") and value > high else None
        raise bad_request(f"{key} must be in [{low}, {high}], got {value}", code=code or "invalid_request")
    return value


def decode_image(url: object, settings: ServeSettings):
    """A PIL RGB image from a base64 data URL, within the size limits; ApiError 400 otherwise."""

    if not isinstance(url, str) or not url.startswith("data:"):
        raise bad_request(
            "images must be base64 data URLs (data:image/png;base64,...); the server fetches no URL",
            code="invalid_image",
        )
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64") or not header[5:].lower().startswith("image/"):
        raise bad_request("an image data URL must look like data:image/<type>;base64,<data>", code="invalid_image")
    if len(payload) > (settings.max_image_bytes * 4) // 3 + 4:
        raise bad_request(f"image over {settings.max_image_bytes} bytes", code="image_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("image data is not valid base64", code="invalid_image") from None
    if len(data) > settings.max_image_bytes:
        raise bad_request(f"image of {len(data)} bytes, over {settings.max_image_bytes}", code="image_too_large")
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        if image.width * image.height > settings.max_image_pixels:  # from the header, before decoding pixels
            raise bad_request(
                f"image of {image.width}x{image.height} pixels, over {settings.max_image_pixels}",
                code="image_too_large",
            )
        image.load()
        return image.convert("RGB")
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - PIL raises many types (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise bad_request(
            f"image data is not a decodable {'/'.join(IMAGE_FORMATS)} image ({type(e).__name__})", code="invalid_image"
        ) from None


def _reply_ids(value: object, index: int, settings: ServeSettings) -> list[int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) > settings.max_tokens_cap + 1
        or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in value)
    ):
        raise bad_request(
            f"messages[{index}].token_ids must be a list of at most {settings.max_tokens_cap + 1} token ids",
            code="invalid_token_ids",
        )
    return value


def _parts(message: dict, index: int, request: ChatRequest, settings: ServeSettings) -> list:
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise bad_request(f"messages[{index}]: content must be a string or a list of parts")
    parts: list = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "image_url":
            if role != "user":
                raise bad_request(f"messages[{index}]: images are accepted in user messages only")
            request.image_count += 1
            if request.image_count > settings.max_images:
                raise bad_request(f"more than {settings.max_images} images in one request", code="too_many_images")
            image_url = part.get("image_url")
            parts.append(decode_image(image_url.get("url") if isinstance(image_url, dict) else image_url, settings))
        else:
            raise bad_request(f"messages[{index}]: content parts must be text or image_url parts")
    return parts


def parse_chat_request(body: object, settings: ServeSettings) -> ChatRequest:
    """Checks the OpenAI request body and decodes its images; every problem is an ApiError 400."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if body.get("stream"):
        raise bad_request("streaming is not supported", code="unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise bad_request("only n = 1 is supported", code="unsupported_parameter")
    given = [key for key in UNSUPPORTED if body.get(key)] + (["logprobs"] if body.get("logprobs") else [])
    if given:
        raise bad_request(f"unsupported parameters: {', '.join(given)}", code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required (a string)")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad_request("messages must be a non-empty list")
    max_tokens = _integer(body, "max_completion_tokens", 1, settings.max_tokens_cap)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, settings.max_tokens_cap)
    request = ChatRequest(
        model=model,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        max_tokens=max_tokens,
        seed=_integer(body, "seed", 0, 2**63 - 1),
        return_token_ids=bool(body.get("return_token_ids")),
    )
    text_chars = 0
    for index, message in enumerate(raw_messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad_request(f"messages[{index}] must be an object with role one of {', '.join(ROLES)}")
        parts = _parts(message, index, request, settings)
        token_ids = _reply_ids(message.get("token_ids"), index, settings)
        if token_ids is not None and message["role"] != "assistant":
            raise bad_request(
                f"messages[{index}]: token_ids are accepted on assistant messages only", code="invalid_token_ids"
            )
        text_chars += sum(len(p) for p in parts if isinstance(p, str))
        if text_chars > 64 * settings.max_model_len:
            raise bad_request(
                f"the prompt exceeds the context length of {settings.max_model_len} tokens",
                code="context_length_exceeded",
            )
        request.messages.append(Message(message["role"], parts, token_ids))
    return request


# ---------------------------------------------------------------- the prompt


def _reply_tokens(codec, message: Message, index: int, vocab_size: int) -> list[int]:
    """An assistant reply's ids: the ids it was sampled as, when the client sent them back and they are that
    reply (they decode to its text), else its text tokenized; always closed by `<|im_end|>`."""
    text = "".join(p for p in message.parts if isinstance(p, str))
    ids = message.token_ids
    if ids is None:
        ids = codec.tokenizer.encode(text, add_special_tokens=False)
    else:
        forbidden = set(codec.forbidden_ids())
        if any(i >= vocab_size or i in forbidden for i in ids):
            raise bad_request(
                f"messages[{index}].token_ids holds ids outside the vocabulary or vision tokens",
                code="invalid_token_ids",
            )
        if codec.decode(ids) != text:
            raise bad_request(
                f"messages[{index}].token_ids do not decode to the message's content", code="invalid_token_ids"
            )
    ids = list(ids)
    return ids if ids and ids[-1] == codec.im_end_id else ids + [codec.im_end_id]


def _refuse_vision_markers(messages: list[Message]) -> None:
    """Text that spells a vision special token would become one and break the image/feature count."""
    for index, message in enumerate(messages):
        for part in message.parts:
            if isinstance(part, str) and any(marker in part for marker in VISION_MARKERS):
                raise bad_request(
                    f"messages[{index}]: text may not contain vision special tokens ({', '.join(VISION_MARKERS)})"
                )


def encode_conversation(codec, messages: list[Message]) -> tuple[list[int], list]:
    """Token ids (image pads expanded) and images of a conversation plus the assistant prompt.

    ChatML as the model's chat template writes it, cut into the same segments app.rollout.encoding.ChatCodec encodes
    separately: text is encoded between images (at `<|vision_start|>` / `<|vision_end|>`) and around each
    assistant reply, whose ids are the reply's own tokens followed by `<|im_end|>`. A rollout's context is the
    same string split at the same special tokens, so the ids are the same."""
    tok = codec.tokenizer
    vocab_size = len(tok)
    _refuse_vision_markers(messages)
    ids: list[int] = []
    images: list = []
    pending = ""

    def flush(text: str) -> None:
        if text:
            ids.extend(tok.encode(text, add_special_tokens=False))

    for index, message in enumerate(messages):
        if message.role == "assistant":
            flush(pending + "<|im_start|>assistant\n")
            ids.extend(_reply_tokens(codec, message, index, vocab_size))
            pending = "\n"
            continue
        pending += f"<|im_start|>{message.role}\n"
        for part in message.parts:
            if isinstance(part, str):
                pending += part
            else:
                flush(pending + "<|vision_start|>")
                ids.extend([codec.image_pad_id] * codec.image_tokens(part))
                images.append(part)
                pending = "<|vision_end|>"
        pending += "<|im_end|>\n"
    flush(pending + "<|im_start|>assistant\n")
    return ids, images


async def read_json(request, limit: int) -> object:
    """The request body as JSON, refused with 413 past `limit` bytes (before reading it, where declared)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None
