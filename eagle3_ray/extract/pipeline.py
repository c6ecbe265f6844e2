"""Stage 1: conversations -> hidden-state Parquet dataset, on Ray Data.

    read + normalize (driver, streaming; skips counted by reason; done sample_ids filtered out)
      -> Tokenize        CPU actor pool: chat template + assistant loss mask
      -> VerifierExtractor actor pool, one verifier replica per actor (num_gpus=gpus_per_replica):
           [optional] regenerate the assistant turns with the verifier, batched
           engine hf: forward in micro-batches packed to a token budget, hooks capture 3 aux
             layers + last; engine vllm: a vLLM engine (its own environment, Ray's
             py_executable; tensor-parallel over the replica's GPUs) captures them with
             `extract_hidden_states` (engine/vllm.py)
           write its own Parquet part atomically (name = hash of its sample ids), return a summary
      -> driver: sums the summaries, checks every sample is there exactly once, writes manifest.json

Hidden states go from the actor straight to storage and never through Ray's object store.
Resume = run the same command again: finished parts are kept, their sample_ids skipped,
interrupted temp files removed. A dying actor is restarted by Ray and its batch retried; a
retried batch rewrites the same part file, so nothing is duplicated.

    eagle3-ray extract --inputs embedded:sharegpt --limit 16 --max-length 256 --output /tmp/hs
    eagle3-ray extract --engine vllm --limit 16 --max-length 256 --output /tmp/hs-vllm
"""
from __future__ import annotations

import collections
import json
import os
import time
import zlib
from dataclasses import asdict, dataclass, field, replace

import pyarrow as pa
import pyarrow.compute as pc

from eagle3_ray import __version__
from eagle3_ray.data import conversations as data, schema
from eagle3_ray.engine import hf as verifier, vllm as vllm_engine
from eagle3_ray.extract import regen

SUMMARY_SCHEMA = pa.schema([("file", pa.string()), ("samples", pa.int64()), ("tokens", pa.int64()),
                            ("loss_tokens", pa.int64()), ("skipped", pa.string()),
                            ("seconds", pa.float64()), ("init_s", pa.float64()),
                            ("regen_tokens", pa.int64()), ("regen_s", pa.float64())])


# A custom node-type resource is requested in a sliver: it pins work to the nodes that carry it
# without limiting how much work fits on one (GPUs/CPUs do that).
NODE_RESOURCE_SLIVER = 0.001
STATS_NAMESPACE = "eagle3_ray"  # Ray namespace of the online StatsActor (online.py)
TOKENIZE_CPUS = 0.5             # Ray CPUs of a Tokenize actor
GPU_REPLICA_CPUS = 0.25         # Ray CPUs of a GPU verifier replica (its GPUs do the work)


@dataclass
class ExtractConfig:
    inputs: list[str] = field(default_factory=lambda: [data.EMBEDDED_SHAREGPT])  # files/dirs/URIs
    output: str = "runs/extract"         # dataset directory: local path or pyarrow-filesystem URI
    verifier: str = verifier.EMBEDDED_VERIFIER  # transformers dir, .gguf file, or embedded:smollm2
    engine: str = "hf"                   # who holds the verifier: hf (transformers) | vllm
    engine_model: str | None = None      # vllm: the transformers dir it loads (run_extract sets
                                         # it: a GGUF verifier is converted once, on the driver)
    layer_ids: list[int] | None = None   # aux layers, vLLM convention, each >= 1, sorted
                                         # ascending; None = (2, L//2, L-3)
    max_length: int = 2048               # tokens per sample after the chat template (truncate)
    sample_limit: int | None = None      # first N usable conversations (defines the dataset)
    sample_offset: int = 0               # ... after skipping this many usable ones
    replicas: int = 1                    # verifier replicas = extractor actors
    gpus_per_replica: int = 0            # 0 = CPU; >1 shards one replica over that many GPUs
    max_gpu_memory: str | None = None    # per-GPU cap for the device map, e.g. "70GiB"
    cpus_per_replica: float | None = None  # Ray CPUs per CPU-only replica (GPU replicas take
                                         # 0.25); None: 1, or what fits a local Ray's machine
                                         # beside the tokenizer actors (launch.fit_cpus)
    node_resource: str | None = None     # custom resource of the node type to run replicas on
                                         # (e.g. extract_node, cluster/); a sliver is requested
    torch_threads: int = 0               # CPU replicas: torch threads; 0 = cores // replicas
    token_budget: int = 0                # padded tokens per verifier forward (micro-batch);
                                         # 0 = 16384 on GPUs, 2048 on CPU (micro_batch_tokens)
    batch_rows: int = 64                 # samples per Ray Data batch (= per Parquet part, unless
    part_bytes: int = 1 << 30            # ... its hidden states pass this size: then several)
    tokenizer_actors: int = 1            # CPU actors running the chat template + mask ahead
                                         # of GPU replicas; CPU replicas (and 0) tokenize their
                                         # own batches (tokenizes_in_extractor)
    dtype: str | None = None             # verifier compute dtype; None = bf16 on GPU, fp32 on CPU
    hidden_storage: str = "bf16"         # stored hidden states: bf16 (8·H B/token, lossless
                                         # bf16) | fp8_e4m3 (4·H+16: e4m3 + a float32 scale per
                                         # token and slot; format 3; schema.py)
    regenerate: bool = False             # the verifier rewrites the assistant turns first
    regen_max_new_tokens: int = 512      # per regenerated assistant turn
    regen_temperature: float = 0.0       # 0 = greedy
    regen_top_p: float = 1.0
    regen_seed: int = 0
    regen_batch: int = 64                # rows per generation batch (regen.BatchGenerator)
    regen_token_budget: int = 65536      # KV tokens per generation batch: rows x (prompt + new)
    emit: str = "parts"                  # parts: write Parquet parts, return summaries (offline);
                                         # rows: hand the hidden-state rows on (online training),
                                         # also written as parts when `output` is set (the cache)
    stats_actor: str | None = None       # online: name of the StatsActor counting each batch
    # tests only: "die_once:<marker file>" kills an actor once; "sleep:<s>" slows each batch.
    fault_injection: str = field(default_factory=lambda: os.environ.get("EAGLE3_RAY_FAULT", ""))


def dataset_facts(cfg: ExtractConfig, config, tokenizer) -> dict:
    """Everything that identifies the dataset; stored in each part and in the manifest."""
    # Sorted: the engines concatenate the aux states in ascending layer order (check_layer_ids).
    n_layers = verifier.text_config(config).num_hidden_layers
    layer_ids = verifier.check_layer_ids(
        sorted(cfg.layer_ids or verifier.default_aux_layer_ids(n_layers)),
        n_layers, where="--layer-ids (ExtractConfig.layer_ids)")
    facts = verifier.verifier_facts(cfg.verifier, config, tokenizer, layer_ids)
    regen = None
    if cfg.regenerate:
        regen = {"max_new_tokens": cfg.regen_max_new_tokens, "temperature": cfg.regen_temperature,
                 "top_p": cfg.regen_top_p, "seed": cfg.regen_seed}
    facts.update(max_length=cfg.max_length, regenerate=regen, tool_version=__version__,
                 hidden_storage=schema.check_storage(cfg.hidden_storage))
    return facts


def replica_threads(cfg: ExtractConfig) -> int:
    """Torch threads of one CPU-only extractor replica: cfg.torch_threads, else cores // replicas."""
    return cfg.torch_threads or max(1, (os.cpu_count() or 1) // cfg.replicas)


def micro_batch_tokens(cfg: ExtractConfig) -> int:
    """Padded tokens per verifier forward: cfg.token_budget, else 16384 on GPUs and 2048 on
    CPU, where [16, 512] costs ~6% more per token than [4, 512] or [1, 512] (its activations
    leave the cache; measured on SmolLM2, bf16 AVX512-BF16 and fp32 AVX2, docs/benchmarks.md).
    Engine vllm: the prompts of one generate call (vLLM schedules them itself), 4096 on CPU:
    its prompt logprobs hold [tokens, vocab] fp32 logits."""
    if cfg.engine == "vllm":
        return cfg.token_budget or (16384 if cfg.gpus_per_replica else 4096)
    return cfg.token_budget or (16384 if cfg.gpus_per_replica else 2048)


def pipeline_cpus(cfg: ExtractConfig) -> float:
    """Ray CPUs of the pipeline's actors other than CPU-only verifier replicas: tokenizer
    actors, and GPU replicas' 0.25 each."""
    return ((0.0 if tokenizes_in_extractor(cfg) else TOKENIZE_CPUS * cfg.tokenizer_actors)
            + (GPU_REPLICA_CPUS * cfg.replicas if gpu_replicas(cfg) else 0.0))


def fit_cpus(cfg: ExtractConfig) -> ExtractConfig:
    """cfg with its CPUs per CPU-only replica decided (launch.fit_cpus)."""
    from eagle3_ray import launch
    fit = launch.fit_cpus(pipeline_cpus(cfg),
                          replica=(cfg.cpus_per_replica, 0 if gpu_replicas(cfg) else cfg.replicas))
    return replace(cfg, cpus_per_replica=fit["replica"])


def gpu_replicas(cfg: ExtractConfig) -> bool:
    return cfg.gpus_per_replica > 0


def tokenizes_in_extractor(cfg: ExtractConfig) -> bool:
    """Whether the extractor actors tokenize their own batches (no Tokenize stage): with
    --regenerate (they tokenize what they generated), with CPU replicas (their torch threads
    take the cores: a Tokenize actor would only add a process start, ~3 CPU-s of imports and
    tokenizer load, and preempt those threads for ~1% of the work) and with tokenizer_actors=0."""
    return cfg.regenerate or cfg.gpus_per_replica == 0 or cfg.tokenizer_actors == 0


def replica_runtime_env(cfg: ExtractConfig) -> dict | None:
    """The extractor actors' runtime_env: offline CPU replicas run at niceness 0. Ray starts
    its workers at niceness 15, so every nice-0 process on the node (the driver, raylet, GCS,
    any other user's job) preempts one of the replica's torch threads at once, and the other
    waits at the next barrier. Measured on 2 cores (bench extract, 3 alternating pairs): 0.91
    of the plain loop at niceness 0 against 0.90 at 15, within the noise, so this is a guard for
    a shared node more than a speed-up. Online (emit="rows") they keep Ray's 15, as the training
    workers beside them do; GPU replicas too (their CPU threads only feed the GPU)."""
    if cfg.engine == "vllm":          # vLLM's own environment, whatever the placement
        env = vllm_engine.runtime_env(replica_threads(cfg), gpus=cfg.gpus_per_replica)
        if not cfg.gpus_per_replica and cfg.emit == "parts":
            env["env_vars"]["RAY_worker_niceness"] = "0"
        return env
    if cfg.gpus_per_replica or cfg.emit != "parts":
        return None
    return {"env_vars": {"RAY_worker_niceness": "0"}}


def tokenize_batch(tok, batch: pa.Table, max_length: int) -> pa.Table:
    """(sample_id, messages_json) -> + input_ids, loss_mask, skip_reason ("" when kept)."""
    ids, masks, reasons = [], [], []
    for m in batch.column("messages_json").to_pylist():
        try:
            i, k = data.tokenize_conversation(tok, json.loads(m), max_length)
            reason = ""
        except data.SkipRecord as e:
            i, k, reason = [], [], e.args[0]
        ids.append(i), masks.append(k), reasons.append(reason)
    return batch.append_column("input_ids", pa.array(ids, pa.list_(pa.int32()))) \
                .append_column("loss_mask", pa.array(masks, pa.list_(pa.uint8()))) \
                .append_column("skip_reason", pa.array(reasons, pa.string()))


class Tokenize:
    """Ray Data CPU actor: messages JSON -> input_ids + loss_mask (or a skip reason)."""

    def __init__(self, verifier_spec: str, max_length: int):
        self.tok = verifier.load_tokenizer(verifier_spec)
        self.max_length = max_length

    def __call__(self, batch: pa.Table) -> pa.Table:
        return tokenize_batch(self.tok, batch, self.max_length)


def regen_start(messages: list[dict]) -> list[dict]:
    """The conversation regeneration starts from: assistant turns before the first user turn are
    dropped (there is nothing they answer; system turns are kept). SkipRecord("no_user_turn")
    if there is no user turn at all."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        raise data.SkipRecord("no_user_turn")
    return [m for m in messages[:first] if m["role"] != "assistant"] + messages[first:]


def part_values(row: dict, aux, last, greedy, storage: str) -> dict:
    """One sample's part-column values: its row's ids and mask, and its padded aux [>=S, 3, H],
    last [>=S, H] and greedy [>=S] cut to its S tokens, hidden states encoded as `storage`."""
    n = len(row["input_ids"])
    aux_b, aux_s = schema.encode_hidden(aux[:n], storage)                      # [S, 3, H]
    last_b, last_s = schema.encode_hidden(last[:n], storage)                   # [S, H]
    values = {"sample_id": row["sample_id"], "input_ids": row["input_ids"],
              "loss_mask": row["loss_mask"], "num_tokens": n, "aux_hidden_states": aux_b,
              "last_hidden_states": last_b, "target_ids": greedy[:n].tolist()}  # [S]
    if aux_s is not None:  # fp8_e4m3: a float32 scale per token and slot
        values.update(aux_hidden_scales=aux_s, last_hidden_scales=last_s)      # [S, 3], [S]
    return values


def batch_counts(tables: list[pa.Table]) -> dict:
    """Samples, tokens and loss (assistant) tokens in these part tables."""
    return {"samples": sum(t.num_rows for t in tables),
            "tokens": sum(sum(t.column("num_tokens").to_pylist()) for t in tables),
            "loss_tokens": sum(int(pc.sum(pc.list_flatten(
                t.column("loss_mask"))).as_py() or 0) for t in tables)}


def regen_failed(sample_id: str, stage: str, error: Exception,
                 skipped: collections.Counter) -> None:
    """Count (skip reason `regen_failed`) and log a record regeneration could not use."""
    print(f"[extract] {sample_id}: regeneration failed {stage}, record skipped "
          f"({type(error).__name__}: {error})")
    skipped["regen_failed"] += 1


def turn_prompts(tok, cfg: ExtractConfig, convs: dict, sids: dict, turn: int,
                 skipped: collections.Counter):
    """Jobs (c, message index) for each conversation's `turn`-th answer, with their prompts,
    max_new and seeds. A failing prompt drops its conversation; no room ends it (turn 0: drops)."""
    jobs, prompts, max_new, seeds = [], [], [], []
    for c, conv in list(convs.items()):
        idx = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
        if turn >= len(idx):
            continue
        i = idx[turn]
        try:
            enc = data.prompt_ids(tok, conv[:i])
        except Exception as e:  # noqa: BLE001 - e.g. a template refusing the roles
            regen_failed(sids[c], f"while rendering the prompt of turn {turn}", e, skipped)
            del convs[c]
            continue
        room = cfg.max_length - len(enc)
        if room <= 0 and turn == 0:  # not even the first answer fits
            skipped["regen_prompt_exceeds_max_length"] += 1
            del convs[c]
            continue
        if room <= 0:  # no room left: the conversation ends before this turn
            convs[c] = conv[:i]
            continue
        jobs.append((c, i))
        prompts.append(enc)
        max_new.append(min(cfg.regen_max_new_tokens, room))
        # per-row seed: a sample's answer does not depend on which rows share its batch
        seeds.append(zlib.crc32(f"{cfg.regen_seed}:{sids[c]}:{turn}".encode()))
    return jobs, prompts, max_new, seeds


def tokenize_regenerated(tok, convs: dict, sids: dict, max_length: int,
                         skipped: collections.Counter) -> list[dict]:
    """Regenerated conversations -> rows (sample_id, input_ids, loss_mask); a conversation with
    no non-empty answer, or that fails to tokenize, is counted in `skipped` instead."""
    out = []
    for c, conv in convs.items():
        try:
            if not any(m["role"] == "assistant" and m["content"].strip() for m in conv):
                raise data.SkipRecord("regenerated_empty")
            ids, mask = data.tokenize_conversation(tok, conv, max_length)
        except data.SkipRecord as e:
            skipped[e.args[0]] += 1
            continue
        except Exception as e:  # noqa: BLE001
            regen_failed(sids[c], "while tokenizing the result", e, skipped)
            continue
        out.append({"sample_id": sids[c], "input_ids": ids, "loss_mask": mask})
    return out


def maybe_die(fault_injection: str) -> None:
    """Fault injection for tests: "die_once:<marker>" kills this process once (the marker file
    remembers it), so the batch must be retried on a restarted actor; "sleep:<s>" slows down."""
    kind, _, arg = fault_injection.partition(":")
    if kind == "die_once" and not os.path.exists(arg):
        open(arg, "w").close()
        os._exit(1)
    if kind == "sleep":
        time.sleep(float(arg))


class VerifierExtractor:
    """Ray Data actor holding one verifier replica (sharded over its GPUs)."""

    def __init__(self, cfg: ExtractConfig, facts: dict):
        import torch
        t0 = time.perf_counter()
        self.cfg, self.facts = cfg, facts
        if cfg.gpus_per_replica == 0:
            torch.set_num_threads(replica_threads(cfg))
        self.model = self.engine = None
        if cfg.engine == "vllm":       # in vLLM's environment (extraction_stages' runtime_env)
            self.engine = vllm_engine.VllmVerifier(
                cfg.engine_model, facts["aux_layer_ids"], facts["num_layers"],
                max_model_len=cfg.max_length + 1, batch_tokens=micro_batch_tokens(cfg),
                **vllm_engine.engine_kwargs(model=cfg.engine_model, dtype=cfg.dtype,
                                            gpus=cfg.gpus_per_replica,
                                            replicas=cfg.replicas))
            self.tok = verifier.load_tokenizer(cfg.engine_model)
        else:
            dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
            self.model = verifier.load_verifier(cfg.verifier, dtype, cfg.gpus_per_replica,
                                                cfg.max_gpu_memory)
            self.tok = verifier.load_tokenizer(cfg.verifier)
            self.device = self.model.get_input_embeddings().weight.device
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        self.generator = None  # regen.BatchGenerator, built on the first --regenerate batch
        self.part_schema = schema.schema_for(cfg.hidden_storage)  # fp8: + the scale columns
        self.fs, self.root = schema.resolve_fs(cfg.output) if cfg.output else (None, None)
        self.stats = None
        if cfg.stats_actor:
            import ray
            self.stats = ray.get_actor(cfg.stats_actor, namespace=STATS_NAMESPACE)
        self.init_s = time.perf_counter() - t0  # reported once, with the first batch

    def __call__(self, batch: pa.Table) -> pa.Table:
        """Offline (emit="parts"): write the batch's Parquet part(s), return a one-row summary.
        Online (emit="rows"): return the hidden-state rows themselves (the part schema), also
        written as parts when `output` is set (the cache)."""
        t0 = time.perf_counter()
        tables, skipped, regen_tokens, regen_s = self._extract(batch)
        write = self.cfg.emit == "parts" or bool(self.cfg.output)
        files = []
        for i, t in enumerate(tables):
            if write:
                files.append(self._write_table(t))
            if i == 0:
                maybe_die(self.cfg.fault_injection)  # tests: after the first part, before the rest
        if not tables:
            maybe_die(self.cfg.fault_injection)
        stats = batch_counts(tables)
        seconds = time.perf_counter() - t0
        if self.stats is not None:  # online: the throughput-balance counters
            self.stats.add.remote("extract", samples=stats["samples"], tokens=stats["tokens"],
                                  seconds=seconds, skipped=dict(skipped))
        if self.cfg.emit == "rows":
            return pa.concat_tables(tables) if tables else self._empty_table()
        return pa.table({
            "file": [",".join(files)], "samples": [stats["samples"]], "tokens": [stats["tokens"]],
            "loss_tokens": [stats["loss_tokens"]], "skipped": [json.dumps(dict(skipped))],
            "seconds": [seconds], "init_s": [self._take_init_s()],
            "regen_tokens": [regen_tokens], "regen_s": [regen_s],
        }, schema=SUMMARY_SCHEMA)

    def _extract(self, batch: pa.Table):
        """-> (hidden-state tables of at most ~part_bytes each, skip counts, regenerated tokens,
        regeneration seconds). Rows are length-sorted, so a retried batch gives the same tables."""
        if not self.cfg.regenerate and "input_ids" not in batch.column_names:
            batch = tokenize_batch(self.tok, batch, self.cfg.max_length)  # tokenizes_in_extractor
        rows = batch.to_pylist()
        skipped = collections.Counter()
        regen_tokens, regen_s = 0, 0.0
        if self.cfg.regenerate:
            t_regen = time.perf_counter()
            tokens0 = self.generator.stats.new_tokens if self.generator else 0
            rows = self._regenerate(rows, skipped)
            regen_tokens = (self.generator.stats.new_tokens if self.generator else 0) - tokens0
            regen_s = time.perf_counter() - t_regen
        else:
            for r in rows:
                if r["skip_reason"]:
                    skipped[r["skip_reason"]] += 1
            rows = [r for r in rows if not r["skip_reason"]]
        return self._hidden_tables(rows), skipped, regen_tokens, regen_s

    def _hidden_tables(self, rows: list[dict]) -> list[pa.Table]:
        """Tokenized rows -> part tables of their hidden states, forwarded in micro-batches
        packed to the token budget; a table closes once it holds part_bytes of hidden states."""
        out, tables, nbytes, storage = self._empty_part(), [], 0, self.cfg.hidden_storage
        for group in regen.pack_by_token_budget([len(r["input_ids"]) for r in rows],
                                          micro_batch_tokens(self.cfg)):
            aux, last, greedy = self._forward([rows[i]["input_ids"] for i in group])
            for j, i in enumerate(group):  # aux [B, S, 3, H], last [B, S, H], greedy [B, S]
                for k, v in part_values(rows[i], aux[j], last[j], greedy[j], storage).items():
                    out[k].append(v)
                nbytes += len(rows[i]["input_ids"]) * schema.hidden_bytes_per_token(
                    aux[j].shape[-1], storage)
            if nbytes >= self.cfg.part_bytes:  # bound memory: close a table (one part each)
                tables.append(pa.table(out, schema=self.part_schema))
                out, nbytes = self._empty_part(), 0
        if out["sample_id"]:
            tables.append(pa.table(out, schema=self.part_schema))
        return tables

    def _empty_table(self) -> pa.Table:
        return self.part_schema.empty_table()

    def _empty_part(self) -> dict:
        return {k: [] for k in self.part_schema.names}

    def _write_table(self, table: pa.Table) -> str:
        """Write one part. Parts split a batch in a deterministic order (length-sorted), so a
        retried batch rewrites the same files."""
        return schema.write_part(self.fs, self.root, table, self.facts)

    def _take_init_s(self) -> float:
        init_s, self.init_s = self.init_s, 0.0
        return init_s

    def _forward(self, seqs: list[list[int]]):
        """-> aux [B, >=S, 3, H], last [B, >=S, H], greedy [B, >=S]: bf16 hidden states (padded
        tensors from hf, per-sequence lists from vllm), each row cut to its length later."""
        import torch
        if self.engine is not None:
            aux, last, greedy = self.engine.hidden_states(seqs)
            return ([a.to(torch.bfloat16) for a in aux], [x.to(torch.bfloat16) for x in last],
                    greedy)
        s = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), s), self.pad_id, dtype=torch.long)      # [B, S] right-padded
        mask = torch.zeros((len(seqs), s), dtype=torch.long)                 # [B, S]
        for i, x in enumerate(seqs):
            ids[i, :len(x)] = torch.tensor(x)
            mask[i, :len(x)] = 1
        aux, last, greedy = verifier.forward_hidden(self.model, ids.to(self.device),
                                                    mask.to(self.device), self.facts["aux_layer_ids"])
        # [B, S, 3, H], [B, S, H], [B, S]
        return aux.to(torch.bfloat16).cpu(), last.to(torch.bfloat16).cpu(), greedy.cpu()

    def _regenerate(self, rows: list[dict], skipped: collections.Counter) -> list[dict]:
        """Replace every assistant turn by the verifier's own answer, turn by turn, batched
        across conversations (regen.BatchGenerator); then tokenize. User and system turns are
        kept; assistant turns before the first user turn are dropped (regen_start). A record
        that fails anywhere here is skipped and counted by reason; it never stops the batch."""
        convs, sids = {}, {}
        for r in rows:  # c -> conversation still being regenerated
            try:
                convs[len(sids)] = regen_start(json.loads(r["messages_json"]))
            except data.SkipRecord as e:
                skipped[e.args[0]] += 1
            except Exception as e:  # noqa: BLE001 - one record never stops the job
                regen_failed(r["sample_id"], "while reading messages_json", e, skipped)
            sids[len(sids)] = r["sample_id"]
        turn = 0
        while True:
            jobs, prompts, max_new, seeds = turn_prompts(self.tok, self.cfg, convs, sids, turn,
                                                         skipped)
            if not jobs:
                break
            for (c, i), toks in zip(jobs, self._generate(prompts, max_new, seeds,
                                                         [sids[c] for c, _ in jobs], skipped)):
                if toks is None:  # generation failed for this record (counted)
                    convs.pop(c, None)
                    continue
                text = self.tok.decode(toks, skip_special_tokens=True).strip()
                convs[c][i] = {"role": "assistant", "content": text}
            turn += 1
        return tokenize_regenerated(self.tok, convs, sids, self.cfg.max_length, skipped)

    def _generate(self, prompts: list[list[int]], max_new: list[int], seeds: list[int],
                  sids: list[str], skipped: collections.Counter) -> list[list[int] | None]:
        """New token ids per prompt, batched; if a batch fails, each prompt is retried alone
        and the ones that still fail come back as None (their records are skipped)."""
        if self.engine is not None:    # vLLM batches and schedules the prompts itself
            return self.engine.generate(prompts, max_new, seeds, self.cfg.regen_temperature,
                                        self.cfg.regen_top_p)
        if self.generator is None:
            self.generator = regen.BatchGenerator(
                self.model, self.pad_id, verifier.eos_ids(self.model, self.tok),
                regen.GenerateConfig(temperature=self.cfg.regen_temperature,
                                     top_p=self.cfg.regen_top_p,
                                     token_budget=self.cfg.regen_token_budget,
                                     max_batch=self.cfg.regen_batch))
        try:
            return self.generator.generate(prompts, max_new, seeds)
        except Exception as e:  # noqa: BLE001
            print(f"[extract] regeneration of {len(prompts)} prompts failed ({type(e).__name__}: "
                  f"{e}); retrying them one by one")
        out = []
        for p, m, s, sid in zip(prompts, max_new, seeds, sids):
            try:
                out.append(self.generator.generate([p], [m], [s])[0])
            except Exception as e:  # noqa: BLE001
                regen_failed(sid, "while generating", e, skipped)
                out.append(None)
        return out


def existing_parts(fs, root: str, facts: dict) -> dict[str, str]:
    """sample_id -> part path for everything already written; refuses a foreign dataset."""
    done = {}
    for path in schema.list_parts(fs, root):
        schema.check_compatible(schema.part_facts(fs, path), facts, where=path)
        for sid in schema.read_column(fs, path, "sample_id"):
            if sid in done:
                raise schema.DatasetMismatch(f"{path}: sample {sid!r} also in {done[sid]}")
            done[sid] = path
    return done


def finalize(cfg: ExtractConfig, facts: dict, read_stats: data.ReadStats,
             run: dict, extra_summary: dict | None = None) -> dict:
    """Scan the parts (footers + small columns), verify uniqueness, write manifest.json."""
    fs, root = schema.resolve_fs(cfg.output)
    files, seen, tokens, loss_tokens, nbytes, target_ids = [], set(), 0, 0, 0, True
    hidden_disk = 0   # compressed bytes of the hidden-state columns (scales included)
    for path in schema.list_parts(fs, root):
        p = schema.part_stats(fs, path)
        ids = p["sample_ids"]
        dup = seen.intersection(ids)
        if dup or len(set(ids)) != len(ids):
            raise RuntimeError(f"{path}: duplicated sample ids {sorted(dup)[:5]}")
        seen.update(ids)
        files.append({"name": os.path.basename(path), "rows": len(ids), "tokens": p["tokens"],
                      "bytes": p["bytes"]})
        tokens, loss_tokens = tokens + p["tokens"], loss_tokens + p["loss_tokens"]
        nbytes += p["bytes"]
        hidden_disk += p["hidden_bytes"]
        target_ids = target_ids and p["target_ids"]
    if cfg.regenerate:  # generated tokens over the actors' time inside regeneration
        run = {**run, "regen_tokens_per_s": run["regen_tokens"] / max(run["regen_s"], 1e-9)}
    skipped = collections.Counter(read_stats.skipped)
    skipped.update(run["skipped"])
    summary = {
        "samples": len(seen), "tokens": tokens, "loss_tokens": loss_tokens,
        "skipped": dict(sorted(skipped.items())),
        "bytes": nbytes, "bytes_per_token": nbytes / max(1, tokens),
        "target_ids": target_ids and bool(files),   # every part stores the verifier's argmax
        "hidden_storage": facts["hidden_storage"],
        # the storage's floor (bf16: 8·H, fp8_e4m3: 4·H + 16), the bf16 floor, and on disk
        "hidden_bytes_per_token": schema.hidden_bytes_per_token(facts["hidden_size"],
                                                                facts["hidden_storage"]),
        "bf16_hidden_bytes_per_token": 8 * facts["hidden_size"],
        "hidden_disk_bytes_per_token": hidden_disk / max(1, tokens),
        "this_run": {k: run[k] for k in ("samples", "tokens", "wall_s", "tokens_per_s",
                                         "resumed_samples", "actor_init_s", "actor_batch_s",
                                         "regen_tokens", "regen_s", "regen_tokens_per_s")
                     if k in run},
        **(extra_summary or {}),
    }
    manifest = {"format": schema.FORMAT,
                "format_version": schema.format_version(facts["hidden_storage"]),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "facts": facts, "config": asdict(cfg), "summary": summary, "files": files}
    schema.write_manifest(cfg.output, manifest)
    return manifest


def with_engine_model(cfg: ExtractConfig) -> ExtractConfig:
    """Engine vllm: check its environment exists (engine_python raises with the set-up command)
    and give it a transformers directory (a GGUF verifier is converted here, once)."""
    if cfg.engine not in ("hf", "vllm"):
        raise ValueError(f"engine {cfg.engine!r}: hf or vllm")
    if cfg.engine != "vllm":
        return cfg
    vllm_engine.engine_python()
    return replace(cfg, engine_model=os.path.abspath(verifier.materialize(cfg.verifier)))


def run_extract(cfg: ExtractConfig, address: str | None = None) -> dict:
    """Run (or resume) extraction; returns the manifest. Checks the inputs and the verifier
    first, then connects to Ray at `address` / $RAY_ADDRESS or starts a local one."""
    from eagle3_ray.launch import init_ray
    data.expand_inputs(cfg.inputs), verifier.resolve(cfg.verifier)  # fail fast, before Ray
    schema.check_storage(cfg.hidden_storage)
    cfg = replace(cfg, output=schema.absolute(cfg.output),
                  verifier=verifier.absolute_spec(cfg.verifier))
    cfg = with_engine_model(cfg)
    init_ray(address)
    cfg = fit_cpus(cfg)
    t0 = time.perf_counter()
    tok, config = verifier.load_tokenizer(cfg.verifier), verifier.load_config(cfg.verifier)
    facts = dataset_facts(cfg, config, tok)
    fs, root = schema.resolve_fs(cfg.output)
    fs.create_dir(root, recursive=True)
    schema.remove_temp_files(fs, root)
    done = existing_parts(fs, root, facts)

    read_stats, todo = data.ReadStats(), []
    for sid, messages in data.iter_samples(cfg.inputs, cfg.sample_limit, read_stats,
                                            cfg.sample_offset):
        if sid not in done:
            todo.append((sid, json.dumps(messages)))
    print(f"[extract] {read_stats.kept} usable conversations ({len(done)} already written, "
          f"{len(todo)} to do); skipped while reading: {dict(read_stats.skipped)}")

    run = {"samples": 0, "tokens": 0, "skipped": collections.Counter(),
           "resumed_samples": len(done), "actor_init_s": 0.0, "actor_batch_s": 0.0,
           "regen_tokens": 0, "regen_s": 0.0}
    if todo:
        ds = build_pipeline(cfg, facts, todo)
        for summary in ds.iter_rows():
            run["samples"] += summary["samples"]
            run["tokens"] += summary["tokens"]
            run["skipped"].update(json.loads(summary["skipped"]))
            run["actor_init_s"] += summary["init_s"]
            run["actor_batch_s"] += summary["seconds"]
            run["regen_tokens"] += summary["regen_tokens"]
            run["regen_s"] += summary["regen_s"]
    run["wall_s"] = time.perf_counter() - t0
    run["tokens_per_s"] = run["tokens"] / run["wall_s"]
    manifest = finalize(cfg, facts, read_stats, run)
    print_summary(cfg.output, manifest)
    return manifest


def build_pipeline(cfg: ExtractConfig, facts: dict, todo: list[tuple[str, str]]):
    """The offline Ray Data plan: input blocks -> Tokenize actors -> VerifierExtractor actors."""
    import ray
    blocks = [pa.table({"sample_id": [s for s, _ in todo[i:i + cfg.batch_rows]],
                        "messages_json": [m for _, m in todo[i:i + cfg.batch_rows]]})
              for i in range(0, len(todo), cfg.batch_rows)]
    return extraction_stages(ray.data.from_arrow(blocks), cfg, facts)


def tokenize_stage(ds, cfg: ExtractConfig):
    """(sample_id, messages_json) rows -> + input_ids, loss_mask, skip_reason (Tokenize actors)."""
    import ray
    return ds.map_batches(Tokenize, fn_constructor_args=(cfg.verifier, cfg.max_length),
                          batch_size=cfg.batch_rows, batch_format="pyarrow",
                          compute=ray.data.ActorPoolStrategy(min_size=1,
                                                             max_size=cfg.tokenizer_actors),
                          num_cpus=TOKENIZE_CPUS)


def extraction_stages(ds, cfg: ExtractConfig, facts: dict):
    """(sample_id, messages_json) rows -> [Tokenize actors] -> VerifierExtractor actors, one
    verifier replica each: summaries (emit="parts") or hidden-state rows (emit="rows")."""
    import ray
    if not tokenizes_in_extractor(cfg):
        ds = tokenize_stage(ds, cfg)
    gpu = gpu_replicas(cfg)
    return ds.map_batches(
        VerifierExtractor, fn_constructor_args=(cfg, facts), batch_size=cfg.batch_rows,
        batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=cfg.replicas),
        num_gpus=cfg.gpus_per_replica if gpu else None,
        num_cpus=GPU_REPLICA_CPUS if gpu else cfg.cpus_per_replica,
        resources={cfg.node_resource: NODE_RESOURCE_SLIVER} if cfg.node_resource else None,
        runtime_env=replica_runtime_env(cfg))


def print_summary(output: str, manifest: dict) -> None:
    s = manifest["summary"]
    print(f"[extract] dataset {output}: {s['samples']} samples, {s['tokens']} tokens "
          f"({s['loss_tokens']} assistant), {s['bytes'] / 2**20:.1f} MiB = "
          f"{s['bytes_per_token']:.0f} B/token on disk, hidden states "
          f"{s.get('hidden_disk_bytes_per_token', 0):.0f} of them ("
          + (f"fp8_e4m3 floor 4·H+16 = {s['hidden_bytes_per_token']} B/token; "
             if s.get("hidden_storage") == "fp8_e4m3" else "")
          + f"bf16 floor 8·H = {s.get('bf16_hidden_bytes_per_token', s['hidden_bytes_per_token'])})")
    r = s["this_run"]
    print(f"[extract] this run: {r['samples']} samples, {r['tokens']} tokens in {r['wall_s']:.1f}s "
          f"= {r['tokens_per_s']:.0f} tokens/s; resumed past {r['resumed_samples']}; "
          f"skipped: {s['skipped']}")
    if "regen_tokens_per_s" in r:
        print(f"[extract] regenerated {r['regen_tokens']} tokens in {r['regen_s']:.1f}s of actor "
              f"time = {r['regen_tokens_per_s']:.1f} tokens/s")
