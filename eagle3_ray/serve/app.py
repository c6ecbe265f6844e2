"""Stage 3: the speculative decoder (speculate.py) behind an OpenAI-compatible API on Ray Serve.

    POST /v1/chat/completions, POST /v1/completions   OpenAI schema, SSE streaming, usage with
                                                       speculation stats (rounds, acceptance)
    GET  /v1/models, GET /health, GET /metrics        Prometheus text (this replica's counters)

One deployment (FastAPI ingress) holds the verifier and the drafter. Placement: `gpus_per_replica`
GPUs (the verifier sharded over them) and, with `node_resource`, a custom resource only the
PCIe node type carries, so the replica lands there and nowhere else. Ray Serve does the rest:
`max_ongoing_requests` per replica, `max_queued_requests` (overflow -> 503 at once),
autoscaling, `request_timeout_s` (-> 408; the replica answers its own 408, an OpenAI error,
just before the proxy would), and cancelling the request when a client disconnects. Each
replica decodes one round at a time on one worker thread; concurrent
requests interleave round by round (no cross-request batching in the built-in engine —
`engine="vllm"` serves a Kimi-sized verifier through ray.serve.llm, see vllm.py).

    eagle3-ray serve --drafter runs/demo/train/drafter --depth 4     # prints the URL
    serve run cluster/serve.yaml                                      # the same, from YAML
"""

import asyncio
import concurrent.futures
import functools
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace

import torch
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from ray import serve

from eagle3_ray.data import conversations as data
from eagle3_ray.engine import hf as verifier_lib
from eagle3_ray.plan import planner
from eagle3_ray.serve import speculate, validate
from eagle3_ray.serve.validate import ApiError, ChatRequest, CompletionRequest, parse
from eagle3_ray.train import checkpoint
# Prometheus text -> dict lives with its reader, the planner (no serve <-> planner import circle);
# serve.parse_metrics stays for the demo and tests that read /metrics.
from eagle3_ray.plan.planner import parse_metrics  # noqa: F401
from eagle3_ray.serve.profile import (PARALLEL_KS, measure_draft_parallel, measure_speculator,
                                      with_round_forward)

log = logging.getLogger("ray.serve")


@dataclass
class ServeConfig:
    verifier: str = verifier_lib.EMBEDDED_VERIFIER  # transformers dir / safetensors / GGUF / embedded
    drafter: str | None = None            # trained drafter dir (<train output>/drafter); None =
                                          # plain decoding only (depth 0)
    model_name: str = "eagle3-ray"        # the OpenAI "model" id clients send
    depth: int = 4                        # default speculation depth (0 = plain decoding)
    depth_schedule: list | None = None    # engine vllm, `--depth auto`: [[batch from, to, k],
                                          # ...] (plan/load.py; depth = its largest k), served
                                          # as num_speculative_tokens_per_batch_size
    max_depth: int = 16                   # bound of the per-request `speculation_depth`
    dynamic_depth: bool = False           # requests without speculation_depth: each round's
                                          # depth from their acceptance so far (planner)
    branches: int = 1                     # greedy requests draft this many chains forked at
                                          # the first draft, verified as one tree (SGLang's
                                          # speculative-eagle-topk); sampled ones one chain.
                                          # Pays where a verify of more tokens costs ~the same
                                          # (docs/serve.md#branches)
    lookup: bool = True                   # builtin engine: the lookup fallback (speculate.
                                          # LookupParams): a chain round whose first draft the
                                          # drafter doubts verifies the continuation of an
                                          # n-gram seen earlier in the request instead
                                          # (docs/serve.md#lookup-fallback)
    lookup_branch: bool = False           # greedy requests verify the lookup's match beside
                                          # the drafter's chain (a tree) instead of in its
                                          # place; pays where more verified tokens cost little
                                          # (an AMX CPU, a GPU; docs/serve.md#lookup-branch)
    profile: str | None = None            # node profile dynamic depth plans with (name/path);
                                          # None = measured on the replica at start
    simulate_interconnect: str | None = None  # SIMULATION: a node profile whose all-reduce
                                          # time is added to every verify (planner.comm_s)
    engine: str = "builtin"               # builtin (transformers + speculate.py) | vllm
    gpus_per_replica: float = 0           # GPUs per replica; the verifier is sharded over them
    cpus_per_replica: float | None = None  # Ray CPUs per replica; None: 1, or what fits a local
                                          # Ray's machine (launch.fit_cpus)
    node_resource: str | None = None      # custom resource of the node type to pin to (pcie_node)
    num_replicas: int = 1
    autoscaling: dict | None = None       # Serve autoscaling_config; overrides num_replicas
    max_ongoing_requests: int = 4         # per replica
    max_queued_requests: int = 16         # beyond: 503 at once
    request_timeout_s: float = 300.0      # 408 after this: the replica's own (JSON; a stream's
                                          # last event) just before the proxy's
                                          # (http_options; plain text, e.g. when queued)
    api_key: str | None = field(default_factory=lambda: os.environ.get("EAGLE3_RAY_API_KEY"))
    max_request_bytes: int = 8 << 20     # request bodies beyond: 413 (validate.read_body)
    max_model_len: int | None = None      # prompt + output tokens; default: the verifier's
    dtype: str | None = None              # engine vllm: bf16 | fp32 | fp16; None: bf16 on GPUs
                                          # and CPUs with native bf16, else fp32 (engine.vllm)
    eager: bool | None = None             # engine vllm: enforce_eager; None: eager on CPU hosts
                                          # with < 8 cores (torch.compile's start-up outweighs)
    default_max_tokens: int = 256         # when a request gives none
    torch_threads: int = 0                # 0 = cpus_per_replica (CPU) / torch default (GPU)
    host: str = "127.0.0.1"
    port: int = 8000

    @classmethod
    def from_dict(cls, d: dict) -> "ServeConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"serve config: unknown field(s) {unknown} (known: {sorted(known)})")
        return cls(**d)


# --- requests and errors ----------------------------------------------------------------------

# ApiError, ChatRequest / CompletionRequest, parse and the checks both engines share
# live in serve/validate.py (the vLLM engine's ingress runs them in vLLM's environment).


# --- metrics -------------------------------------------------------------------------------

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """This replica's counters, rendered as Prometheus text."""

    def __init__(self, kernels: dict[int, str] | None = None, exact: dict | None = None):
        self.lock = threading.Lock()
        self.kernels = dict(kernels or {})                  # fp32 rows -> kernel timed at start
        self.exact = dict(exact or {})                      # Speculator.exact: path -> bool
        self.requests: dict[tuple[str, str], int] = {}      # (endpoint, status) -> count
        self.c = dict(prompt_tokens=0, generation_tokens=0, rounds=0, drafted_tokens=0,
                      accepted_tokens=0, lookup_rounds=0)
        self.drafted_at: dict[int, int] = {}               # position -> rounds that drafted it
        self.accepted_at: dict[int, int] = {}              # position -> rounds that accepted it
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0

    def request(self, endpoint: str, status: str, latency_s: float | None = None):
        with self.lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1
            if latency_s is not None:
                self.latency_sum += latency_s
                i = next((i for i, b in enumerate(LATENCY_BUCKETS) if latency_s <= b),
                         len(LATENCY_BUCKETS))
                self.latency[i] += 1

    def rounds(self, prompt_tokens: int, rounds: list[speculate.Round]):
        with self.lock:
            self.c["prompt_tokens"] += prompt_tokens
            for r in rounds:
                self.c["generation_tokens"] += len(r.tokens)
                if r.drafted == 0 and r is rounds[0]:
                    continue                                   # the prefill's first token
                self.c["rounds"] += 1
                self.c["lookup_rounds"] += r.lookup
                self.c["drafted_tokens"] += r.drafted
                self.c["accepted_tokens"] += r.accepted
                for k in range(r.drafted):
                    self.drafted_at[k] = self.drafted_at.get(k, 0) + 1
                    if k < r.accepted:
                        self.accepted_at[k] = self.accepted_at.get(k, 0) + 1

    def render(self) -> str:
        p = "eagle3_ray_"
        with self.lock:
            lines = [f"# TYPE {p}requests_total counter"]
            lines += [f'{p}requests_total{{endpoint="{e}",status="{s}"}} {n}'
                      for (e, s), n in sorted(self.requests.items())]
            for name, v in self.c.items():
                lines += [f"# TYPE {p}{name}_total counter", f"{p}{name}_total {v}"]
            tau = (self.c["accepted_tokens"] + self.c["rounds"]) / max(1, self.c["rounds"])
            lines += [f"# HELP {p}acceptance_length mean tokens per verify round",
                      f"# TYPE {p}acceptance_length gauge", f"{p}acceptance_length {tau:.6f}",
                      f"# TYPE {p}drafted_at_position_total counter"]
            lines += [f'{p}drafted_at_position_total{{position="{k}"}} {v}'
                      for k, v in sorted(self.drafted_at.items())]
            lines += [f"# TYPE {p}accepted_at_position_total counter"]
            lines += [f'{p}accepted_at_position_total{{position="{k}"}} {self.accepted_at.get(k, 0)}'
                      for k in sorted(self.drafted_at)]
            if self.kernels:                               # Speculator.few_row_kernels
                lines += [f"# HELP {p}fp32_kernel_info the fp32 kernel timed fastest here for "
                          f"a linear of that many rows", f"# TYPE {p}fp32_kernel_info gauge"]
                lines += [f'{p}fp32_kernel_info{{rows="{k}",kernel="{v}"}} 1'
                          for k, v in sorted(self.kernels.items())]
            if self.exact:                                 # Speculator.check_exact
                lines += [f"# HELP {p}exact_info 1: that verify computes what decoding does on "
                          f"this replica's kernels (checked at start)",
                          f"# TYPE {p}exact_info gauge"]
                lines += [f'{p}exact_info{{path="{k}"}} {int(v)}' for k, v in self.exact.items()]
            lines += [f"# TYPE {p}request_latency_seconds histogram"]
            total = 0
            for b, n in zip(list(LATENCY_BUCKETS) + ["+Inf"], self.latency):
                total += n
                lines.append(f'{p}request_latency_seconds_bucket{{le="{b}"}} {total}')
            lines += [f"{p}request_latency_seconds_sum {self.latency_sum:.6f}",
                      f"{p}request_latency_seconds_count {total}"]
        return "\n".join(lines) + "\n"


# --- the engine (no Ray, no HTTP) ------------------------------------------------------------

def depth_planning(cfg: ServeConfig, spec: speculate.Speculator):
    """The simulated interconnect (if asked) goes onto the Speculator; for dynamic depth, the
    node profile it plans with and the drafter's trained acceptance as the prior ->
    (profile, prior), or (None, None) when the depth is fixed."""
    node = planner.load_profile(cfg.simulate_interconnect) if cfg.simulate_interconnect else None
    if node:
        spec.simulated_comm = functools.partial(planner.comm_s, node)
        log.warning(f"SIMULATION: every verify sleeps the all-reduce time of {node.name} "
                    f"({planner.comm_s(node, 1) * 1e3:.2f} ms for one token)")
    if not cfg.dynamic_depth:
        return None, None
    if not spec.drafter:
        raise ValueError("dynamic_depth needs a drafter (--drafter)")
    if cfg.profile:
        profile = planner.load_profile(cfg.profile)
    else:   # measured here, on this replica's verifier and drafter
        verify_ms, draft_ms = measure_speculator(spec, cfg.max_depth + 1, reps=3)
        profile = planner.single_device_profile("this replica", verify_ms, draft_ms,
                                                spec.model.config)
        if spec.drafter.config.drafting != "chain":   # its round is one forward, any depth
            ks = sorted({k for k in PARALLEL_KS if k <= cfg.max_depth} | {cfg.max_depth})
            profile = with_round_forward(profile, spec.drafter,
                                         measure_draft_parallel(spec.drafter, ks, reps=3))
    if node:
        profile = planner.with_interconnect(profile, node)
    try:
        prior = planner.acceptance_from(cfg.drafter)[0]
    except ValueError:
        prior = [0.5]
        log.warning(f"{cfg.drafter}: no held-out acceptance in its metadata; dynamic depth "
                    f"starts from a prior of 0.5 per position")
    return profile, prior


class Engine:
    """Tokenizer + verifier + drafter + Speculator; turns validated requests into rounds."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        if cfg.torch_threads or not cfg.gpus_per_replica:
            torch.set_num_threads(cfg.torch_threads or max(1, int(cfg.cpus_per_replica or 1)))
        vcfg = verifier_lib.load_config(cfg.verifier)
        self.ttt_steps = None
        if cfg.drafter:
            self.ttt_steps = checkpoint.check_drafter(cfg.drafter, vcfg, cfg.verifier).get(
                "ttt_steps")
        elif cfg.depth:
            raise ValueError(f"depth {cfg.depth} needs a drafter (--drafter), or use depth 0")
        if not 0 <= cfg.depth <= cfg.max_depth <= 32:
            raise ValueError(f"need 0 <= depth ({cfg.depth}) <= max_depth ({cfg.max_depth}) <= 32")
        if not 1 <= cfg.branches <= 16:
            raise ValueError(f"need 1 <= branches ({cfg.branches}) <= 16")
        self.tok = verifier_lib.load_tokenizer(cfg.verifier)
        model = verifier_lib.load_verifier(cfg.verifier, num_gpus=int(cfg.gpus_per_replica))
        drafter = None
        if cfg.drafter:
            from eagle3_ray.train.checkpoint import load_trained_drafter
            drafter = load_trained_drafter(cfg.drafter, cfg.verifier)[0]
        self.spec = speculate.Speculator(model, drafter)
        if self.spec.few_row_kernels:
            log.info(f"fp32 kernels by rows, timed here: {self.spec.few_row_kernels}")
        self.lookup = speculate.LookupParams() if cfg.lookup and drafter is not None else None
        self.branches, tree = cfg.branches, cfg.branches > 1 or bool(self.lookup and
                                                                      cfg.lookup_branch)
        self.fallbacks = []                # what this replica serves instead, and why
        if tree and not self.spec.exact["tree"]:
            self.branches, tree = 1, False
            self.fallbacks.append("chains instead of trees (branches 1, no lookup branch): "
                                  + self.spec.inexact_reason("tree"))
        if drafter is not None and not self.spec.exact["chain"]:
            self.fallbacks.append("depth 0 for every request: "
                                  + self.spec.inexact_reason("chain"))
        for f in self.fallbacks:
            log.warning(f"this replica serves {f}")
        self.lookup_greedy = (speculate.LookupParams(branch=True) if tree and self.lookup and
                              cfg.lookup_branch else self.lookup)     # trees: greedy only
        self.max_model_len = cfg.max_model_len or getattr(vcfg, "max_position_embeddings", 2048)
        self.eos_ids = verifier_lib.eos_ids(model, self.tok)
        self.depth_profile, self.prior = depth_planning(cfg, self.spec)
        if self.ttt_steps and cfg.depth > self.ttt_steps:
            log.warning(f"default depth {cfg.depth} > the drafter's trained ttt_steps "
                        f"{self.ttt_steps}: positions past it are extrapolation")

    def prompt_ids(self, req) -> list[int]:
        """The request's prompt tokens (the chat template over validated messages)."""
        if isinstance(req, ChatRequest):
            messages = validate.chat_messages(req.messages)
            try:
                ids = data.prompt_ids(self.tok, messages)
            except Exception as e:
                raise ApiError(400, f"messages do not fit the chat template: {e}", "messages")
        else:
            ids = self.tok(validate.completion_prompt(req.prompt))["input_ids"]
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        return list(ids)

    def sampling(self, req, n_prompt: int) -> tuple[speculate.SamplingParams, int, list[str]]:
        """Validate the request's sampling fields -> (params, depth, stop strings)."""
        stop = validate.check_sampling(req, self.cfg.model_name)
        max_tokens = validate.max_tokens_of(req)
        room = validate.check_context(n_prompt, max_tokens, self.max_model_len)
        if req.speculation_depth is None and self.cfg.dynamic_depth:
            c = self.spec.drafter.config
            depth = planner.DynamicDepth(
                self.depth_profile, self.prior,
                planner.depth_bound(c.drafting, self.cfg.max_depth, c.block_size),
                drafting=c.drafting, block_layers=c.block_layers)
        else:
            depth = self.cfg.depth if req.speculation_depth is None else req.speculation_depth
            if not 0 <= depth <= self.cfg.max_depth or (depth and not self.spec.drafter):
                raise ApiError(400, f"speculation_depth must be in [0, "
                                    f"{self.cfg.max_depth if self.spec.drafter else 0}], got "
                                    f"{depth}", "speculation_depth")
        if not self.spec.exact["chain"]:
            depth = 0                      # a verify of several tokens is not exact here
        sp = speculate.SamplingParams(
            max_tokens=max_tokens or min(room, self.cfg.default_max_tokens),
            temperature=req.temperature, top_p=req.top_p, seed=req.seed, eos_ids=self.eos_ids)
        return sp, depth, stop

    def warning(self, depth) -> str | None:
        if self.ttt_steps and not callable(depth) and depth > self.ttt_steps:
            return (f"speculation_depth {depth} > the drafter's trained ttt_steps "
                    f"{self.ttt_steps}: acceptance past it is extrapolation")
        return None


def usage(n_prompt: int, rounds: list[speculate.Round], depth, warning: str | None) -> dict:
    """OpenAI usage + this request's speculation stats (rounds after the prefill). `depth`: an
    int, or a dynamic-depth policy (reported as "dynamic", with the mean depth per round)."""
    out = sum(len(r.tokens) for r in rounds)
    verify = rounds[1:]
    drafted = sum(r.drafted for r in verify)
    accepted = sum(r.accepted for r in verify)
    deepest = max([r.drafted for r in verify], default=0) if callable(depth) else depth
    spec = {"depth": "dynamic" if callable(depth) else depth, "rounds": len(verify),
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_length": (accepted + len(verify)) / max(1, len(verify)),
            "lookup_rounds": sum(r.lookup for r in verify),
            "accepted_per_position": [sum(r.accepted > k for r in verify)
                                      for k in range(deepest)]}
    if callable(depth):
        spec["mean_depth"] = drafted / max(1, len(verify))
    if warning:
        spec["warning"] = warning
    return {"prompt_tokens": n_prompt, "completion_tokens": out,
            "total_tokens": n_prompt + out, "speculation": spec}


TIMEOUT_MARGIN_S = 1.0    # the replica's 408 comes this much (at most 10%) before the proxy's


def app_timeout_s(request_timeout_s: float) -> float:
    """When the replica itself answers 408: a little before the proxy's own request_timeout_s
    (http_options), which counts from the proxy's receipt and whose 408 has a plain-text body
    (no JSON) and, once a stream has started, is only a cut connection."""
    return request_timeout_s - min(TIMEOUT_MARGIN_S, 0.1 * request_timeout_s)


class RequestTimeout(ApiError):
    """408 from the replica: generation ran past request_timeout_s. Checked between rounds, so
    it frees the request's slot at once; a stream gets it as its last event (then [DONE])."""

    def __init__(self, timeout_s: float, tokens: int):
        super().__init__(408, f"request timed out after {timeout_s:g}s (the server's "
                              f"request_timeout_s) with {tokens} tokens generated; ask for "
                              f"fewer max_tokens or raise --request-timeout-s",
                         type_="timeout_error", code="request_timeout")


class _Job:
    """One request's decoding: steps the Speculator's generator on the replica's decode thread
    (one round per step, so requests interleave), detokenizes with stop strings, and records
    metrics exactly once however it ends (done, error, client gone)."""

    def __init__(self, server, prompt, sp, depth, stop, endpoint, rid, t0,
                 warning, include_usage):
        self.server, self.prompt, self.depth, self.endpoint = server, prompt, depth, endpoint
        self.rid, self.t0, self.warning, self.include_usage = rid, t0, warning, include_usage
        branches = server.engine.branches if sp.temperature == 0 else 1       # trees: greedy
        lookup = server.engine.lookup_greedy if sp.temperature == 0 else server.engine.lookup
        self.gen = server.engine.spec.generate(prompt, sp, depth, branches, lookup)
        self.text = speculate.TextStream(server.engine.tok, stop)
        self.rounds: list[speculate.Round] = []
        self.closed = False
        timeout = server.cfg.request_timeout_s
        self.deadline = t0 + app_timeout_s(timeout) if timeout and timeout > 0 else None

    async def step(self) -> tuple[str, str | None, bool]:
        """Next round -> (new text, finish_reason, done). Past the deadline: RequestTimeout."""
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            raise RequestTimeout(self.server.cfg.request_timeout_s,
                                 sum(len(r.tokens) for r in self.rounds))
        loop = asyncio.get_running_loop()
        r = await loop.run_in_executor(self.server.pool, next, self.gen, None)
        if r is None:
            return self.text.push([], final=True), "stop", True
        self.rounds.append(r)
        piece = self.text.push(r.tokens, final=r.finish_reason is not None)
        if self.text.stopped:
            return piece, "stop", True
        return piece, r.finish_reason, r.finish_reason is not None

    async def run(self) -> tuple[str, str]:
        out = []
        while True:
            piece, reason, done = await self.step()
            out.append(piece)
            if done:
                return "".join(out), reason

    def usage(self) -> dict:
        return usage(len(self.prompt), self.rounds, self.depth, self.warning)

    def close(self, status: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.server.pool.submit(self.gen.close)  # after a round in flight, on the same thread
        m = self.server.metrics
        m.rounds(len(self.prompt), self.rounds)
        m.request(self.endpoint, status, time.perf_counter() - self.t0)

    def chunk(self, delta_text: str | None, reason: str | None, first: bool = False) -> str:
        if self.endpoint == "chat":
            delta = {"role": "assistant", "content": ""} if first else \
                ({"content": delta_text} if delta_text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta_text or "", "finish_reason": reason,
                      "logprobs": None}
            obj = "text_completion"
        body = {"id": self.rid, "object": obj, "created": int(time.time()),
                "model": self.server.cfg.model_name, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    async def sse(self):
        status = "cancelled"  # unless it finishes (a disconnect cancels this task)
        try:
            if self.endpoint == "chat":
                yield self.chunk(None, None, first=True)
            while True:
                try:
                    piece, reason, done = await self.step()
                except RequestTimeout as e:     # the status line is sent: an error event
                    status = str(e.status)
                    yield f"data: {json.dumps(e.body())}\n\n"
                    break
                except Exception as e:
                    status = "500"
                    log.exception("generation failed")
                    err = {"error": {"message": f"generation failed: {e}",
                                     "type": "server_error", "param": None, "code": None}}
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                if piece:
                    yield self.chunk(piece, None)
                if done:
                    yield self.chunk(None, reason)
                    if self.include_usage:
                        final = json.loads(self.chunk(None, None)[6:])
                        final["choices"], final["usage"] = [], self.usage()
                        yield f"data: {json.dumps(final)}\n\n"
                    status = "200"
                    break
            yield "data: [DONE]\n\n"
        finally:
            self.close(status)


# --- the Ray Serve deployment ---------------------------------------------------------------
# Everything the deployment class uses is defined above it: Serve pickles the class when the
# decorator runs, with the module globals that exist at that moment.

api = FastAPI(title="eagle3_ray")


@serve.deployment
@serve.ingress(api)
class SpeculativeServer:
    def __init__(self, cfg: dict):
        self.cfg = ServeConfig.from_dict(cfg)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decode")
        # The engine is built (weights, profile measurement) on the thread that decodes: libgomp
        # counts the OpenMP threads of every thread's team, and a second team (this thread's,
        # from loading, plus the decode thread's) outnumbers 2 cores, which cuts its spin-wait
        # to ~nothing: plain decoding ran x1.65 slower (docs/benchmarks.md#openmp-wait-policy).
        self.engine = self.pool.submit(Engine, self.cfg).result()
        self.metrics = Metrics(self.engine.spec.few_row_kernels, self.engine.spec.exact)
        self.key_digest = validate.key_digest(self.cfg.api_key) if self.cfg.api_key else None

    async def check_health(self) -> None:
        """Serve's health check (every HEALTH_CHECK_PERIOD_S, 2 s): the engine lives on the
        decode thread, so the replica is healthy when that thread takes a no-op behind the
        rounds queued before it. A wedged engine fails the check (health_check_timeout_s, 30 s)
        and Serve replaces the replica after 3 failures; a dead process is replaced at once."""
        await asyncio.get_running_loop().run_in_executor(self.pool, int)

    def _auth(self, request: Request) -> None:
        validate.check_api_key(request.headers.get("authorization"), self.key_digest)

    @api.get("/health")
    async def health(self):
        return {"status": "ok", "exact": self.engine.spec.exact,
                "fallbacks": self.engine.fallbacks}

    @api.get("/metrics")
    async def prometheus(self):
        return PlainTextResponse(self.metrics.render(),
                                 media_type="text/plain; version=0.0.4")

    @api.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._auth(request)
        except ApiError as e:
            return e.response()
        return {"object": "list", "data": [{
            "id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "eagle3_ray",
            "max_model_len": self.engine.max_model_len, "speculation_depth": self.cfg.depth,
            "max_speculation_depth": self.cfg.max_depth, "drafter_ttt_steps": self.engine.ttt_steps}]}

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._complete(request, ChatRequest, "chat")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, CompletionRequest, "completions")

    async def _complete(self, request: Request, kind, endpoint: str):
        t0 = time.perf_counter()
        try:
            self._auth(request)
            req = parse(await validate.read_body(request, self.cfg.max_request_bytes), kind)
            prompt = self.engine.prompt_ids(req)
            sp, depth, stop = self.engine.sampling(req, len(prompt))
        except ApiError as e:
            self.metrics.request(endpoint, str(e.status))
            return e.response()
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        job = _Job(self, prompt, sp, depth, stop, endpoint, rid, t0,
                   self.engine.warning(depth), include_usage=bool(
                       (req.stream_options or {}).get("include_usage")))
        if req.stream:
            return StreamingResponse(job.sse(), media_type="text/event-stream")
        try:
            text, reason = await job.run()
        except asyncio.CancelledError:
            job.close("cancelled")
            raise
        except RequestTimeout as e:
            job.close(str(e.status))
            return e.response()
        except Exception as e:  # a bug must not take the replica down
            job.close("500")
            log.exception("generation failed")
            return ApiError(500, f"generation failed: {e}", type_="server_error").response()
        job.close("200")
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": reason, "logprobs": None} if endpoint == "chat" else
                  {"index": 0, "text": text, "finish_reason": reason, "logprobs": None})
        return {"id": rid, "object": "chat.completion" if endpoint == "chat" else "text_completion",
                "created": int(time.time()), "model": self.cfg.model_name, "choices": [choice],
                "usage": job.usage()}


# --- building and running the app -------------------------------------------------------------

def build_app(cfg: ServeConfig):
    """The Serve application for `cfg` (checks the drafter against the verifier first)."""
    cfg = fit_cpus(cfg)
    if cfg.engine == "vllm":
        from eagle3_ray.serve.vllm import build_vllm_app
        return build_vllm_app(cfg)
    if cfg.engine != "builtin":
        raise ValueError(f"engine must be builtin or vllm, got {cfg.engine!r}")
    cfg = resolve_paths(cfg)
    if cfg.drafter:
        vcfg = verifier_lib.load_config(cfg.verifier)      # fail here, not in a replica
        checkpoint.check_drafter(cfg.drafter, vcfg, cfg.verifier)
    return SpeculativeServer.options(**deployment_options(cfg)).bind(asdict(cfg))


def fit_cpus(cfg: ServeConfig) -> ServeConfig:
    """cfg with its CPUs per replica decided (launch.fit_cpus; autoscaling: its max_replicas)."""
    from eagle3_ray import launch
    replicas = cfg.autoscaling.get("max_replicas", 1) if cfg.autoscaling else cfg.num_replicas
    return replace(cfg, cpus_per_replica=launch.fit_cpus(
        replica=(cfg.cpus_per_replica, replicas))["replica"])


# Serve notices a dead replica at its next health check: every 10 s by default, so a killed
# replica was replaced ~14 s later (tests/serve/test_faults.py). SpeculativeServer.check_health
# is a no-op on the decode thread, so checking every 2 s costs nothing.
HEALTH_CHECK_PERIOD_S = 2.0


def deployment_options(cfg: ServeConfig) -> dict:
    """The Serve deployment options: replica resources (pinned to `node_resource`), limits,
    health checks, scaling."""
    from eagle3_ray.extract.pipeline import NODE_RESOURCE_SLIVER
    actor = {"num_cpus": cfg.cpus_per_replica, "num_gpus": cfg.gpus_per_replica}
    if cfg.node_resource:
        actor["resources"] = {cfg.node_resource: NODE_RESOURCE_SLIVER}
    scale = ({"autoscaling_config": cfg.autoscaling} if cfg.autoscaling
             else {"num_replicas": cfg.num_replicas})
    return {"ray_actor_options": actor, "max_ongoing_requests": cfg.max_ongoing_requests,
            "max_queued_requests": cfg.max_queued_requests,
            "health_check_period_s": HEALTH_CHECK_PERIOD_S, **scale}


def resolve_paths(cfg: ServeConfig) -> ServeConfig:
    """Local paths made absolute: replicas run in another working directory."""
    from eagle3_ray.data import schema
    return replace(cfg, verifier=verifier_lib.absolute_spec(cfg.verifier),
                   drafter=schema.absolute(cfg.drafter) if cfg.drafter else None)


def app_builder(args: dict):
    """`serve run eagle3_ray.serve.app:app_builder depth=4 ...` and the import_path of
    cluster/serve.yaml: Serve passes the YAML `args` here."""
    return build_app(ServeConfig.from_dict(dict(args)))


def start(cfg: ServeConfig, address: str | None = None, name: str = "eagle3") -> str:
    """Start Serve (HTTP on cfg.host:cfg.port), deploy, return the base URL."""
    from eagle3_ray.launch import init_ray
    init_ray(address)
    serve.start(http_options={"host": cfg.host, "port": cfg.port,
                              "request_timeout_s": cfg.request_timeout_s})
    if cfg.engine == "vllm":               # built and run in vLLM's environment (vllm.py)
        from eagle3_ray.serve import vllm
        vllm.deploy(fit_cpus(cfg), name)
    else:
        serve.run(build_app(cfg), name=name, route_prefix="/")
    url = f"http://{cfg.host}:{cfg.port}"
    if cfg.engine == "builtin":            # what a replica serves instead of the config, and why
        import requests
        probe = url.replace("://0.0.0.0:", "://127.0.0.1:")
        for f in requests.get(f"{probe}/health", timeout=60).json().get("fallbacks", []):
            print(f"[serve] warning: the replica serves {f}", flush=True)
    return url


def run_serve(cfg: ServeConfig, address: str | None = None) -> None:
    """`eagle3-ray serve`: deploy and keep serving until interrupted."""
    url = start(cfg, address)
    print(f"[serve] {cfg.model_name} (depth {cfg.depth}, engine {cfg.engine}) at {url}/v1 "
          f"- try: curl {url}/v1/models", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        serve.shutdown()
