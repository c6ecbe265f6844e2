"""The OpenAI request checks both serving engines share: the API key, the body (size bound,
JSON object), the chat messages (roles, text content) and the sampling fields, including the
project's own `speculation_depth`. Each failure is an `ApiError`: an HTTP status and an
OpenAI error body ({"error": {"message", "type", "param", "code"}}) naming the field.

The builtin app (serve/app.py) runs these before its engine's context checks; the vLLM
engine's ingress (serve/vllm_ingress.py) runs them before handing the request to vLLM, which
checks the context length itself. Light on purpose (pydantic, starlette; no torch, no vLLM):
it is imported in both the project's and vLLM's environment. See it answer:

    eagle3-ray serve --api-key sk-x &
    curl -s localhost:8000/v1/chat/completions -H 'Authorization: Bearer sk-x' -d '{"model":
        "eagle3-ray", "messages": [{"role": "wizard", "content": "hi"}]}'     # 400, param
"""
from __future__ import annotations

import hashlib
import hmac
import json

from pydantic import BaseModel, ConfigDict, ValidationError

# The roles the OpenAI chat API accepts; any other is a 400, never rendered by the template.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_STOPS = 4                             # OpenAI's bound on `stop` strings
DEFAULT_MAX_REQUEST_BYTES = 8 << 20       # bodies beyond: 413 (ServeConfig.max_request_bytes)


class ApiError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = \
            status, message, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self):
        from starlette.responses import JSONResponse
        return JSONResponse(self.body(), status_code=self.status)


# --- the API key -------------------------------------------------------------------------------

def key_digest(key: str) -> str:
    """sha256 hex of an API key: what a config may carry instead of the key itself."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def check_api_key(authorization: str | None, digest: str | None) -> None:
    """401 unless the Authorization header is `Bearer <key>` with key_digest(key) == digest
    (None: no key asked). Compared in constant time."""
    if not digest:
        return
    given = (authorization or "").removeprefix("Bearer ")
    ok = bool(authorization) and authorization.startswith("Bearer ") and \
        hmac.compare_digest(key_digest(given), digest)
    if not ok:
        raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                       type_="authentication_error", code="invalid_api_key")


# --- the body ----------------------------------------------------------------------------------

def too_large(n_bytes: int, limit: int) -> ApiError:
    return ApiError(413, f"request body is {n_bytes} bytes or more; this server takes at most "
                         f"{limit}", code="request_too_large")


async def read_body(request, limit: int) -> bytes:
    """The request body (a starlette Request), 413 beyond `limit` bytes: refused on its
    Content-Length before reading, and while reading when it has none (chunked)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        parts.append(chunk)
    return b"".join(parts)


def json_object(body: bytes) -> dict:
    """The body as a JSON object, else 400."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}")
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


# --- the fields --------------------------------------------------------------------------------

class Sampling(BaseModel):
    """The fields every request has (both endpoints); unknown ones are ignored."""
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0              # OpenAI's default; 0 = greedy
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    speculation_depth: int | None = None  # extension: this request's depth (<= max_depth)


class ChatRequest(Sampling):
    messages: list[dict]


class CompletionRequest(Sampling):
    prompt: str | list[str]


def validated(data: dict, kind: type[BaseModel]):
    """A JSON object as `kind`, else 400 naming the first wrong field."""
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ApiError(400, f"{where}: {err['msg']}", param=where)


def parse(body: bytes, kind: type[BaseModel]):
    """A request body -> `kind` (ChatRequest / CompletionRequest), else 400."""
    return validated(json_object(body), kind)


def chat_messages(messages: list[dict]) -> list[dict]:
    """[{role, content}] with a known role and text content (a string, or content parts whose
    text ones are joined), else 400 naming the message."""
    if not messages:
        raise ApiError(400, "messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content
                              if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ApiError(400, f"messages[{i}] needs a string role and text content",
                           f"messages.{i}")
        if m["role"] not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role: {m['role']!r} is not one of "
                                f"{', '.join(CHAT_ROLES)}", f"messages.{i}.role")
        out.append({"role": m["role"], "content": content})
    return out


def completion_prompt(prompt: str | list[str]) -> str:
    """The one prompt of a completions request, else 400."""
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, "only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "the prompt is empty", "prompt")
    return prompt


def check_sampling(req: Sampling, model_name: str, max_n: int = 1) -> list[str]:
    """The fields every engine checks alike (model, n, temperature, top_p, stop, max_tokens
    > 0) -> the stop strings. The context length and speculation_depth are the engine's."""
    if req.model != model_name:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves "
                            f"{model_name!r}", "model", code="model_not_found")
    if not 1 <= req.n <= max_n:
        raise ApiError(400, "only n=1 is supported" if max_n == 1 else
                       f"n must be in [1, {max_n}], got {req.n}", "n")
    if req.temperature < 0 or req.temperature > 2:
        raise ApiError(400, f"temperature must be in [0, 2], got {req.temperature}",
                       "temperature")
    if not 0 < req.top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {req.top_p}", "top_p")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOPS or any(not s for s in stop):
        raise ApiError(400, f"stop: up to {MAX_STOPS} non-empty strings", "stop")
    max_tokens = max_tokens_of(req)
    if max_tokens is not None and max_tokens <= 0:
        raise ApiError(400, f"max_tokens must be > 0, got {max_tokens}", "max_tokens")
    return stop


def max_tokens_of(req: Sampling) -> int | None:
    return req.max_completion_tokens or req.max_tokens


def check_context(n_prompt: int, max_tokens: int | None, max_model_len: int) -> int:
    """400 when the prompt, or the prompt + max_tokens, exceeds the context -> the room left."""
    room = max_model_len - n_prompt
    if room <= 0:
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens; "
                            f"the prompt has {n_prompt}", "messages",
                       code="context_length_exceeded")
    if max_tokens is not None and max_tokens > room:
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens; "
                            f"the prompt has {n_prompt} and max_tokens is {max_tokens}",
                       "max_tokens", code="context_length_exceeded")
    return room


def check_fixed_depth(depth: int | None, served: int) -> None:
    """vLLM serves one depth (num_speculative_tokens): a request may name it, not another."""
    if depth is not None and depth != served:
        raise ApiError(400, f"speculation_depth: this engine (vLLM) serves the fixed depth "
                            f"{served} (num_speculative_tokens) and cannot change it per "
                            f"request; got {depth} (send {served} or leave it out)",
                       "speculation_depth")
