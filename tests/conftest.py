"""Shared fixtures: a tiny random Llama verifier (real SmolLM2 tokenizer + chat template, read
from the embedded GGUF), small conversation files, and one local Ray cluster for the session."""
import json
import os
import socket

import pytest

import eagle3_ray  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads)
import torch

os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

CONVERSATIONS = [
    {"id": "a", "conversations": [
        {"from": "human", "value": "What is the capital of France?"},
        {"from": "gpt", "value": "The capital of France is Paris."},
        {"from": "human", "value": "And of Italy?"},
        {"from": "gpt", "value": " Rome, which is also its largest city.\n"}]},
    {"id": "b", "conversations": [
        {"from": "system", "value": "You are terse."},
        {"from": "human", "value": "Count to five."},
        {"from": "gpt", "value": "1, 2, 3, 4, 5"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "no answer here"}]},   # skipped
    {"id": "d", "conversations": []},                                                  # skipped
    {"id": "e", "conversations": [
        {"from": "human", "value": "Write some code"},
        {"from": "gpt", "value": "```python\ndef f(x):\n    return x * 2\n```\nDone!"}]},
    {"id": "f", "conversations": [
        {"from": "human", "value": "Hi"}, {"from": "alien", "value": "zzz"}]},          # skipped
]
USABLE_TEXTS = {  # assistant contents of the usable records, by record index
    0: ["The capital of France is Paris.", " Rome, which is also its largest city.\n"],
    1: ["1, 2, 3, 4, 5"],
    4: ["```python\ndef f(x):\n    return x * 2\n```\nDone!"],
}


def make_conversations(n: int) -> list[dict]:
    """n distinct, varied, usable ShareGPT records."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    out = []
    for i in range(n):
        q = " ".join(words[(i + k) % len(words)] for k in range(3 + i % 5))
        a = " ".join(words[(i * 7 + k) % len(words)] for k in range(5 + (i * 3) % 17))
        out.append({"id": f"s{i}", "conversations": [
            {"from": "human", "value": f"Question {i}: {q}?"},
            {"from": "gpt", "value": f"Answer {i}: {a}."}]})
    return out


def free_port() -> int:
    """A TCP port free on this host now (for a Serve proxy or a Ray head of a test's own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_engine_env() -> str | None:
    """Why there is no vLLM environment (engine.vllm.engine_python's RuntimeError), or None.
    A wrong $EAGLE3_RAY_VLLM_PYTHON is an error, not a skip."""
    from eagle3_ray.engine import vllm as engine_vllm
    try:
        engine_vllm.engine_python()
    except RuntimeError as e:
        return str(e)
    return None


def make_tiny_verifier(d, hidden_size: int = 64, heads: int = 4) -> str:
    """Save a random 8-layer Llama with SmolLM2's tokenizer in directory d."""
    from eagle3_ray.engine import toy
    return toy.llama(d, hidden_size, heads)


@pytest.fixture(scope="session")
def tiny_verifier(tmp_path_factory):
    """A transformers directory: random 8-layer Llama, H=64, with SmolLM2's tokenizer."""
    return make_tiny_verifier(tmp_path_factory.mktemp("tiny_verifier"))


@pytest.fixture(scope="session")
def vllm_verifier(tmp_path_factory):
    """The same with H=128 in 2 heads: vLLM's CPU attention has kernels for head sizes of 32
    and more (tiny_verifier's 16 is refused: "Unsupported CPU attention configuration")."""
    return make_tiny_verifier(tmp_path_factory.mktemp("vllm_verifier"), hidden_size=128, heads=2)


@pytest.fixture(scope="session")
def deepseek_verifier(tmp_path_factory):
    """A random 8-layer DeepSeek-V3-shaped verifier (Kimi-K2.5's text model in small: MLA with
    vLLM's CPU head size 576, q-LoRA, a dense first layer, MoE of 8 experts in 2 groups + 1
    shared, sigmoid noaux_tc routing), H=128, SmolLM2's tokenizer (engine/toy.py)."""
    from eagle3_ray.engine import toy
    return toy.deepseek(tmp_path_factory.mktemp("deepseek_verifier"))


@pytest.fixture(scope="session")
def kimi_verifier(tmp_path_factory, deepseek_verifier):
    """deepseek_verifier inside Kimi-K2.5's vision-language wrapper (model_type kimi_k25, the
    text model under text_config, weights under language_model.)."""
    from eagle3_ray.engine import toy
    return toy.kimi(tmp_path_factory.mktemp("kimi_verifier"), text_dir=deepseek_verifier)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_verifier):
    from eagle3_ray.engine import hf as verifier
    return verifier.load_tokenizer(tiny_verifier)


@pytest.fixture
def sharegpt_file(tmp_path):
    """The fixture records as a JSON array cut off in the middle of a 7th record."""
    text = json.dumps(CONVERSATIONS, indent=2)
    partial = json.dumps({"id": "g", "conversations": [{"from": "human", "value": "cut"}]})
    p = tmp_path / "sharegpt.json"
    p.write_text(text[:-2] + ",\n  " + partial[: len(partial) // 2])
    return str(p)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add contention on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             object_store_memory=300 * 2**20)
    yield ray
    ray.shutdown()


@pytest.fixture(params=["onednn", "aten"])
def gemm_path(request):
    """Both CPU GEMM paths of bf16 on any host: "onednn", torch as it runs here (oneDNN's bf16
    kernels where the CPU has them), and "aten", torch.backends.mkldnn off: ATen's own GEMM and
    this package's non-oneDNN paths, what an AVX2-only CPU runs (EAGLE3_RAY_ONEDNN=0 in a
    process). On an AVX2-only CPU both are that path."""
    with torch.backends.mkldnn.flags(enabled=request.param == "onednn"):
        yield request.param


@pytest.fixture
def make_inexact(monkeypatch):
    """make_inexact(path): a MOCK of kernels that round differently (no such CPU here since
    issue 48's fix): from then on a tree verify ("tree") or a verify of several tokens after a
    cache ("chain") adds 0.01 to its attention output, so it no longer computes what its chains
    / decoding do. Patches the module attributes a Speculator registers with transformers, so it
    applies to Speculators built afterwards; the real ones are registered again at teardown."""
    from transformers import AttentionInterface
    from eagle3_ray.serve import kernels

    def make(path: str) -> None:
        if path == "tree":
            real_tree = kernels._tree_attention
            monkeypatch.setattr(kernels, "_tree_attention",
                                lambda *a: (real_tree(*a)[0] + 0.01, None))
            return
        for name in ("batch_invariant_attention", "tree_attention"):   # bf16 / fp32 verifiers
            def attention(module, query, key, *a, real=getattr(kernels, name), tree=None, **kw):
                out, w = real(module, query, key, *a, tree=tree, **kw)
                several = tree is None and 1 < query.shape[2] < key.shape[2]
                return (out + 0.01 if several else out), w
            monkeypatch.setattr(kernels, name, attention)
    yield make
    monkeypatch.undo()
    AttentionInterface.register(kernels.INVARIANT_ATTENTION, kernels.batch_invariant_attention)
    AttentionInterface.register(kernels.TREE_ATTENTION, kernels.tree_attention)


def _train_tiny_drafter(spec: str, out: str, prompts: list[list[int]], steps: int = 40,
                        depth: int = 3, draft_vocab: int = 256, drafting: str = "chain",
                        new_tokens: int = 40, **config) -> str:
    """A drafter trained in-process for `steps` TTT steps (unroll `depth`, hard targets) on the
    verifier's own greedy continuations of `prompts` (so its drafts get accepted when serving
    them), its draft vocab the `draft_vocab` most frequent tokens there, saved as a real
    checkpoint; `config`: DraftConfig fields (draft layer "mla", fc_norm, ...). drafting
    "block": a block.BlockDrafter trained with block.block_loss (blocks of config's block_size
    anchored at every position; `depth` unused). Run it with few torch threads: it is small."""
    import numpy as np
    from eagle3_ray.engine import hf as verifier
    from eagle3_ray.train import checkpoint, draft, kinds, vocab
    model = verifier.load_verifier(spec, dtype=torch.float32)
    with torch.no_grad():
        seqs = [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0]
                for p in prompts]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], att[i, :len(s)] = s, 1
    layer_ids = verifier.default_aux_layer_ids(model.config.num_hidden_layers)
    aux, last, greedy = verifier.forward_hidden(model, ids, att, layer_ids)
    counts = np.bincount(torch.cat([ids[att.bool()], greedy[att.bool()]]).numpy(),
                         minlength=model.config.vocab_size)
    c = draft.DraftConfig.from_verifier_config(model.config, draft_vocab, layer_ids,
                                               drafting=drafting, **config)
    drafter, teacher = kinds.build(spec, c, *vocab.build_mapping(counts, draft_vocab),
                                   teacher_check=False, init="random")
    batch = {"input_ids": ids, "attention_mask": att, "loss_mask": att,   # out of inference mode
             "aux_hidden_states": aux.flatten(2).clone(), "last_hidden_states": last.clone(),
             "target_ids": greedy.clone()}
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss, metrics = kinds.loss(drafter, teacher, batch, depth, targets="hard",
                                   deep_fraction=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {k: v.detach() for k, v in drafter.state_dict().items()
             if not k.startswith("embed_tokens")}
    return checkpoint.save_drafter(out, state, drafter.config,
                                   {"ttt_steps": depth, "verifier": spec, "steps": steps,
                                    "final_metrics": {"train/loss": metrics["loss"]}})


@pytest.fixture(scope="session")
def train_tiny_drafter():
    """_train_tiny_drafter, for tests that serve a drafter which must get drafts accepted."""
    return _train_tiny_drafter


# What both engines answer without `Authorization: Bearer <the key>` (401).
UNAUTHORIZED = {"error": {"message": "invalid or missing API key (Authorization: Bearer <key>)",
                          "type": "authentication_error", "param": None,
                          "code": "invalid_api_key"}}


def malformed_requests(model: str, max_model_len: int, max_bytes: int) -> list[tuple]:
    """The malformed requests both serving engines must refuse with a 4xx and a clear OpenAI
    error body, for a server of `model` with context `max_model_len` and body bound `max_bytes`:
    (name, body (a dict, or raw bytes), status, param the error names (its first part) or None,
    words the message says). One table for both engines (test_serve.py, test_served_vllm.py)."""
    def chat(content="Tell me about rivers.", **kw):
        return {"model": model, "messages": [{"role": "user", "content": content}],
                "temperature": 0, "max_tokens": 4, **kw}

    def messages(*ms):
        return dict(chat(), messages=list(ms))
    big = b'{"model": "%s", "messages": [{"role": "user", "content": "' % model.encode() + \
        b"x" * max_bytes + b'"}]}'
    return [
        ("not json", b"{not json", 400, None, "not valid JSON"),
        ("not an object", b"[1, 2]", 400, None, "JSON object"),
        ("body over the bound", big, 413, None, f"at most {max_bytes}"),
        ("unknown model", dict(chat(), model="nope"), 404, "model", "does not exist"),
        ("no messages", {"model": model}, 400, "messages", "messages"),
        ("messages not a list", dict(chat(), messages="hi"), 400, "messages", "list"),
        ("empty messages", messages(), 400, "messages", "must not be empty"),
        ("content of a wrong type", messages({"role": "user", "content": 5}), 400, "messages",
         "text content"),
        ("unknown role", messages({"role": "user", "content": "hi"},
                                  {"role": "wizard", "content": "zap"}), 400, "messages",
         "'wizard' is not one of system, user"),
        ("prompt beyond the context", chat("word " * (max_model_len + 50)), 400, "messages",
         "maximum context length"),
        ("max_tokens 0", chat(max_tokens=0), 400, "max_tokens", "max_tokens must be > 0"),
        ("max_tokens beyond the context", chat(max_tokens=max_model_len), 400, "max_tokens",
         "maximum context length"),
        ("max_tokens not a number", chat(max_tokens="many"), 400, "max_tokens", "integer"),
        ("negative temperature", chat(temperature=-0.5), 400, "temperature", "[0, 2]"),
        ("top_p 0", chat(top_p=0), 400, "top_p", "(0, 1]"),
        ("five stop strings", chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", "up to 4"),
        ("stop of a wrong type", chat(stop=17), 400, "stop", "stop"),
        ("speculation_depth 999", chat(speculation_depth=999), 400, "speculation_depth",
         "999"),
        ("speculation_depth not a number", chat(speculation_depth="deep"), 400,
         "speculation_depth", "integer"),
        ("n 0", chat(n=0), 400, "n", "n"),
    ]


def check_malformed(url: str, headers: dict, cases: list[tuple], ok_body: dict) -> list[str]:
    """POST each case of `malformed_requests` to url/v1/chat/completions -> what was wrong
    (empty: all refused as the table says); then `ok_body` must still get a 200."""
    import requests
    wrong = []
    for name, body, status, param, says in cases:
        data = body if isinstance(body, bytes) else json.dumps(body)
        r = requests.post(url + "/v1/chat/completions", data=data, timeout=120,
                          headers={"Content-Type": "application/json", **headers})
        try:
            err = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            wrong.append(f"{name}: {r.status_code}, not an OpenAI error body: {r.text[:200]}")
            continue
        if r.status_code != status:
            wrong.append(f"{name}: {r.status_code} (want {status}): {err}")
        elif not err.get("message") or says.lower() not in err["message"].lower():
            wrong.append(f"{name}: message {err.get('message')!r} does not say {says!r}")
        elif param and (err.get("param") or "").split(".")[0] != param:
            wrong.append(f"{name}: param {err.get('param')!r} (want {param}...)")
        elif param and err.get("type") != "invalid_request_error":
            wrong.append(f"{name}: type {err.get('type')!r}")
    r = requests.post(url + "/v1/chat/completions", json=ok_body, headers=headers, timeout=120)
    if r.status_code != 200:
        wrong.append(f"after them, a normal request got {r.status_code}: {r.text[:300]}")
    return wrong
