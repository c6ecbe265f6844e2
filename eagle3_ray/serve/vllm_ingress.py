"""The vLLM engine's OpenAI ingress: Ray Serve LLM's own `OpenAiIngress`, subclassed to give it
what the builtin app (serve/app.py) has — an API key on every route, `GET /health`, a bound on
the body size, and the builtin's request checks (serve/validate.py: roles, content types, the
sampling fields, `speculation_depth`) before vLLM sees a request.

Ray Serve LLM takes a custom ingress class by name: `LLMServingArgs.ingress_cls_config =
{"ingress_cls": "eagle3_ray.serve.vllm_ingress:Eagle3Ingress", "ingress_extra_kwargs": {...}}`
(serve/vllm.py `serving_args` writes it; Ray's builder binds the kwargs to the constructor and
routes its endpoints through `make_fastapi_ingress`). This module imports `ray.serve.llm`, so
only vLLM's environment imports it (the Serve build task and the ingress replica).

  - API key: a pure ASGI middleware in front of the whole ingress app (so before FastAPI
    parses any body) answers 401 with the builtin's body unless `Authorization: Bearer <key>`.
    The config carries the key's sha256 only (`api_key_sha256`), never the key: the Serve app
    config is readable by anyone who can read the cluster's Serve status. `/health` is open,
    as on the builtin app; `/metrics` is its own Serve app (serve/vllm.py) and stays open.
  - Size: the same middleware refuses a Content-Length beyond `max_request_bytes` (413);
    chat and completions also count the bytes of a body sent without one.
  - `/health`: 200 {"status": "ok", ...} once the engine replica answers its health check
    (LLMServer.check_health), 503 before or when it fails.
  - Chat and completions read the raw body themselves: 413 / not JSON / not an object, then
    validate.py's checks, then vLLM's own request model (its errors as 400s), then the
    context: a prompt + max_tokens beyond max_model_len (given in the config) is the builtin's
    400 (vLLM would cut max_tokens instead), the prompt counted with the verifier's tokenizer
    and chat template where its size does not settle it; a prompt alone beyond it is vLLM's
    own 400. Then Ray's handler. Completions' prompts may
    be text, texts or token ids (vLLM takes all of them).
    `speculation_depth` may only name the served depth (vLLM's num_speculative_tokens is per
    engine); it is removed before vLLM sees the request.

The routes and the middleware are added in Serve's `__serve_build_asgi_app__` hook, which a
replica calls after the constructor with the ingress's FastAPI app at hand (`self.app`).

CPU-sized command (needs .venv-vllm and a drafter, as serve/vllm.py's):

    .venv/bin/eagle3-ray serve --engine vllm --verifier \
        "$(.venv/bin/python -m eagle3_ray.engine.hf --materialize)" \
        --drafter runs/demo/train/drafter --depth 3 --api-key sk-x
    curl -s localhost:8000/health; curl -s localhost:8000/v1/models       # 200, then 401
"""
from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, StreamingResponse
from ray.serve.llm.ingress import OpenAiIngress
from ray.serve.llm.openai_api_models import ChatCompletionRequest as VllmChat
from ray.serve.llm.openai_api_models import CompletionRequest as VllmCompletion

from eagle3_ray.serve import validate
from eagle3_ray.serve.validate import ApiError

log = logging.getLogger("ray.serve")
OPEN_PATHS = ("/health",)                 # no key asked (the builtin app's too)
HEALTH_TIMEOUT_S = 10.0
MAX_N = 16                                # vLLM samples n choices per request; bound it
TEMPLATE_SLACK = 2048                     # tokens a chat template may add (upper bound)
CHAT_TEMPLATE_KEYS = ("add_generation_prompt", "continue_final_message", "chat_template",
                      "chat_template_kwargs", "tools")    # what renders the prompt, as vLLM does


class Guard:
    """ASGI middleware: 401 without the API key (except OPEN_PATHS), 413 for a declared body
    over the bound; everything else goes through untouched."""

    def __init__(self, app, digest: str | None, limit: int):
        self.app, self.digest, self.limit = app, digest, limit

    async def __call__(self, scope, receive, send):
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if scope["type"] == "http" and path not in OPEN_PATHS:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                       for k, v in scope.get("headers") or []}
            try:
                validate.check_api_key(headers.get("authorization"), self.digest)
                declared = headers.get("content-length", "")
                if declared.isdigit() and int(declared) > self.limit:
                    raise validate.too_large(int(declared), self.limit)
            except ApiError as e:
                return await e.response()(scope, receive, send)
        return await self.app(scope, receive, send)


def vllm_request(data: dict, kind):
    """vLLM's own request model over the checked body; its refusals as 400s."""
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ApiError(400, f"{where}: {err['msg']}", param=where or None)
    except ValueError as e:                # a model validator's own message
        raise ApiError(400, str(e))


def error_tail(resp):
    """A stream whose engine replica dies mid-way (tests/serve/test_served_vllm.py, faults) ends
    with an error event and [DONE], as the builtin app's does: Ray's ingress would close it
    like a finished one, and an OpenAI client would take the cut text for the whole answer."""
    if not isinstance(resp, StreamingResponse):
        return resp
    body = resp.body_iterator

    async def tail():
        try:
            async for chunk in body:
                yield chunk
        except Exception as e:             # not CancelledError: a client gone stays so
            err = ApiError(500, f"generation failed: the engine replica was lost mid-stream "
                                f"({type(e).__name__}); retry the request", type_="server_error")
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
    resp.body_iterator = tail()
    return resp


class Eagle3Ingress(OpenAiIngress):
    """OpenAiIngress + the API key, /health, the body bound and validate.py's checks."""

    def __init__(self, llm_deployments, model_cards, *, lora_paths=None,
                 model_name: str = "eagle3-ray", depth: int = 0,
                 api_key_sha256: str | None = None,
                 max_request_bytes: int = validate.DEFAULT_MAX_REQUEST_BYTES,
                 max_model_len: int | None = None, tokenizer: str | None = None, **kw):
        super().__init__(llm_deployments, model_cards, lora_paths=lora_paths, **kw)
        self.engines = dict(llm_deployments)
        self.model_name, self.depth = model_name, int(depth)
        self.key_digest, self.max_request_bytes = api_key_sha256, int(max_request_bytes)
        self.max_model_len, self.tokenizer_source = max_model_len, tokenizer
        self._tokenizer = None                 # loaded on first need

    async def __serve_build_asgi_app__(self):
        """Serve's hook, after the constructor: our routes and middleware on Ray's app."""
        app = self.app
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_middleware(Guard, digest=self.key_digest, limit=self.max_request_bytes)
        return app

    async def health(self):
        """200 once the engine replica passes its health check, 503 before / on failure."""
        handle = self.engines[self.model_name]

        async def ping():
            return await handle.check_health.remote()
        try:
            await asyncio.wait_for(ping(), HEALTH_TIMEOUT_S)
        except Exception as e:             # not up yet, dead, or busy past the timeout
            return JSONResponse({"status": "unavailable", "engine": "vllm",
                                 "error": f"{type(e).__name__}: {e}"[:500]}, status_code=503)
        return {"status": "ok", "engine": "vllm", "model": self.model_name,
                "speculation_depth": self.depth}

    async def _checked(self, request: Request, ours, theirs):
        """The raw body -> vLLM's request model, after validate.py's checks."""
        data = validate.json_object(await validate.read_body(request, self.max_request_bytes))
        req = validate.validated(data, ours)
        if ours is validate.ChatRequest:
            validate.chat_messages(req.messages)
        validate.check_sampling(req, self.model_name, max_n=MAX_N)
        validate.check_fixed_depth(req.speculation_depth, self.depth)
        data.pop("speculation_depth", None)    # ours, not vLLM's
        body = vllm_request(data, theirs)
        await self._check_context(data, validate.max_tokens_of(req))
        return body

    async def _check_context(self, data: dict, max_tokens: int | None):
        """The builtin's 400 for a prompt + max_tokens beyond the context (max_model_len, when
        the config gives it): vLLM 0.32 instead cuts max_tokens to the room left. The prompt
        is counted with the verifier's tokenizer and chat template (vLLM's default template)
        only where its bytes + max_tokens do not surely fit; if counting fails, vLLM decides.
        (Not vLLM's /tokenize: Ray 2.60 looks for vLLM's tokenizer under an older name and
        answers every tokenize "not supported" with vLLM 0.32.)"""
        if max_tokens is None or not self.max_model_len or not self.tokenizer_source:
            return
        prompt = data.get("messages", data.get("prompt"))
        upper = len(json.dumps(prompt).encode()) + TEMPLATE_SLACK   # >= its tokens
        if upper + max_tokens <= self.max_model_len:
            return
        try:
            n_prompt = await asyncio.to_thread(self._prompt_tokens, data, prompt)
        except Exception as e:             # vLLM's own path will say what is wrong
            log.warning(f"context check skipped, counting the prompt failed: {e!r}")
            return
        validate.check_context(n_prompt, max_tokens, self.max_model_len)

    def _prompt_tokens(self, data: dict, prompt) -> int:
        """The prompt's tokens (the longest of a batch of completion prompts)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_source)
        tok = self._tokenizer
        if "messages" in data:
            kw = {k: data[k] for k in CHAT_TEMPLATE_KEYS if k in data}
            kw.update(kw.pop("chat_template_kwargs", None) or {})
            kw.setdefault("add_generation_prompt", True)
            ids = tok.apply_chat_template(prompt, tokenize=True, **kw)
            return len(ids["input_ids"] if hasattr(ids, "keys") else ids)
        prompts = prompt if isinstance(prompt, list) and prompt and \
            not isinstance(prompt[0], int) else [prompt]
        return max(len(p) if isinstance(p, list) else len(tok(p)["input_ids"])
                   for p in prompts)             # token ids, or text

    async def chat(self, request: Request):
        try:
            body = await self._checked(request, validate.ChatRequest, VllmChat)
        except ApiError as e:
            return e.response()
        return error_tail(await super().chat(body, request))

    async def completions(self, request: Request):
        try:
            body = await self._checked(request, validate.Sampling, VllmCompletion)
        except ApiError as e:
            return e.response()
        return error_tail(await super().completions(body, request))
