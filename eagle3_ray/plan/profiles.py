"""Node profiles: what one node's forwards cost, as data. A profile (a YAML file, packaged in
eagle3_ray/plan/profiles/<name>.yaml or any path) holds the verify compute time per number of
tokens, the drafter's forward times (one token: draft_step_ms; k query tokens:
draft_parallel_ms; a block drafter's forward: draft_block_ms), the drafter's collectives per
forward and the interconnect: α/β, or a measured all-reduce time per message size
(`interconnect.allreduce_us`), and optionally the verify surface over batch size x tokens
per sequence (`verify_batch_ms`; plan/load.py prices batches with it). Loading checks every
field and names the file and field it refuses; with_draft_layer prices another drafter
decoder layer shape (MLA); the measuring helpers here build a profile from one machine's
timings and an all-reduce curve between processes (`eagle3-ray profile` runs them through
serve/profile.py). cost.py prices rounds with a profile.

    eagle3-ray profile --max-tokens 9 --out /tmp/cpu.yaml          # measure this machine
    eagle3-ray plan --sweep 0.8 --profile /tmp/cpu.yaml --out /tmp/plan   # and plan with it
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
# Collectives of one drafter forward when the drafter runs at the verifier's tensor-parallel
# degree (vLLM V1 and SGLang do; the profiles' comments cite the code): once per forward, the
# vocab-parallel embedding all-reduce and the lm_head logits gather; per decoder layer, the
# attention o_proj and MLP down_proj all-reduces (row-parallel linears).
DRAFT_COLLECTIVES_FIXED = 2
DRAFT_COLLECTIVES_PER_LAYER = 2


def draft_collectives_tp(layers: int = 1) -> int:
    """Collectives of one forward of a `layers`-layer drafter run tensor-parallel:
    2 + 2·layers (an EAGLE-3 / P-EAGLE drafter has one layer: 4; a 2-layer block drafter 6)."""
    return DRAFT_COLLECTIVES_FIXED + DRAFT_COLLECTIVES_PER_LAYER * layers


DRAFT_COLLECTIVES_TP = draft_collectives_tp(1)     # 4: a one-layer drafter's forward

@dataclass
class Interconnect:
    latency_us: float             # α: fixed cost of one all-reduce (µs)
    bandwidth_gbps: float         # BW: effective all-reduce bandwidth, GB/s (1e9 bytes/s)
    allreduces_per_forward: int   # N_ar: tensor-parallel all-reduces per verifier forward
    hidden_size: int              # H: an all-reduce message is tokens·H·B bytes
    bytes_per_elem: int           # B: bytes per activation element (2 = bf16)
    allreduce_us: dict[int, float] | None = None  # measured: message bytes -> µs of one
                                  # all-reduce on the profile's GPUs; used instead of α/β
                                  # when present (allreduce_curve_us)


@dataclass
class NodeProfile:
    name: str
    description: str              # what node, model, and how the numbers were obtained
    sources: list[str]            # spec sheets, model cards, measurements behind the numbers
    gpus: int                     # n: tensor-parallel degree of the verifier (1 = no comm)
    interconnect: Interconnect
    verify_ms: dict[int, float]   # tokens verified -> compute-only ms of one verifier forward
    draft_step_ms: float          # one chain drafter forward (one token), compute only
    draft_collectives: int = 0    # C: collectives per drafter forward (a drafter run tensor-
                                  # parallel over the GPUs: DRAFT_COLLECTIVES_TP; one GPU: 0).
                                  # Old profiles' `draft_allreduces` is read as this
    draft_parallel_ms: dict[int, float] | None = None  # query tokens k -> compute-only ms of
                                  # one drafter forward of k tokens after a cached context (a
                                  # parallel round); None: modelled flat at draft_step_ms
    simulated: bool = False       # True: interconnect borrowed from another node (a simulation)
    draft_layer: str = "llama"    # the drafter decoder layer the draft_* fields above price
    draft_layers: dict[str, dict] | None = None  # other layer shapes ("mla": one DeepSeek MLA
                                  # layer, vLLM's Eagle3DeepseekV3ForCausalLM): their own
                                  # draft_step_ms, draft_collectives, draft_parallel_ms
                                  # (and draft_block_ms, draft_block_layers)
    draft_block_ms: dict[int, float] | None = None  # query tokens (k+1: the bonus token and
                                  # k mask slots) -> compute-only ms of one forward of a block
                                  # (DFlash) drafter of draft_block_layers layers; None:
                                  # modelled from draft_parallel_ms (cost.draft_block_compute_s)
    draft_block_layers: int | None = None  # the layer count draft_block_ms was measured with
    verify_batch_ms: dict[int, dict[int, float]] | None = None  # the verify surface: batch size
                                  # B -> {tokens per sequence t -> compute-only ms of ONE
                                  # verifier forward of B sequences with t new tokens each}.
                                  # Without a batch-1 row, verify_ms is batch 1 (a measured
                                  # surface has its own: the batched engine's kernels). None:
                                  # priced for batch 1 only (the per-batch schedule then serves
                                  # batch 1's depth; plan/load.py)
    round_batch_ms: dict[int, dict[int, float]] | None = None  # measured in the serving engine
                                  # (round_engine; `profile --engine vllm`): depth k -> {batch
                                  # B -> ms of one decode round of B sequences drafting k each}
                                  # (k = 0: the drafter loaded, drafting nothing: a schedule's
                                  # 0). Where present, plan/load.py prices the schedule with it
    plain_batch_ms: dict[int, float] | None = None  # the same engine without a drafter: batch
                                  # B -> ms of one decode step (what depth 0 serves)
    round_engine: str | None = None  # which engine measured the two above (vllm 0.32.0, ...)
    _xs: list = field(default_factory=list, init=False, repr=False, compare=False)
    _ys: list = field(default_factory=list, init=False, repr=False, compare=False)
    _pxs: list = field(default_factory=list, init=False, repr=False, compare=False)
    _pys: list = field(default_factory=list, init=False, repr=False, compare=False)
    _bxs: list = field(default_factory=list, init=False, repr=False, compare=False)
    _bys: list = field(default_factory=list, init=False, repr=False, compare=False)
    _rows: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._xs = sorted(self.verify_ms)
        self._ys = [self.verify_ms[x] for x in self._xs]
        self._pxs = sorted(self.draft_parallel_ms or {})
        self._pys = [self.draft_parallel_ms[x] for x in self._pxs]
        self._bxs = sorted(self.draft_block_ms or {})
        self._bys = [self.draft_block_ms[x] for x in self._bxs]
        # the verify surface by batch size (batch 1: its own row, else verify_ms), each row as
        # sorted (tokens, ms) lists: plan/load.py prices every (batch, depth) with them
        table = {1: self.verify_ms, **(self.verify_batch_ms or {})}
        self._rows = {b: (sorted(table[b]), [table[b][x] for x in sorted(table[b])])
                      for b in sorted(table)}


def _check(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{where}: {msg}")


def _number(d: dict, key: str, where: str, kind=float, minimum: float = 0.0):
    _check(key in d, where, f"missing field '{key}'")
    v = d[key]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v >= minimum
    if kind is int:
        ok = ok and float(v).is_integer()
    _check(ok, where, f"field '{key}' must be {'an integer' if kind is int else 'a number'} "
                      f">= {minimum}, got {v!r}")
    return kind(v)


def _curve(c, where: str) -> dict[int, float] | None:
    """allreduce_us: None, or a mapping of >= 2 message sizes (bytes, integers >= 1) to µs."""
    if c is None:
        return None
    _check(isinstance(c, dict) and len(c) >= 2, where,
           "must be a mapping of at least 2 message sizes (bytes) to microseconds")
    out = {}
    for k, v in c.items():
        _check(isinstance(k, int) and not isinstance(k, bool) and k >= 1, where,
               f"message sizes must be integers (bytes) >= 1, got {k!r}")
        out[k] = _number(c, k, where, float, 1e-12)
    return dict(sorted(out.items()))


def _ms_table(t, where: str, what: str) -> dict[int, float]:
    """A non-empty mapping of token counts (integers >= 1) to ms (numbers > 0)."""
    _check(isinstance(t, dict) and t, where, f"field '{what}' must be a non-empty mapping "
                                             f"tokens -> ms")
    out = {}
    for k in t:
        _check(isinstance(k, int) and not isinstance(k, bool) and k >= 1, where,
               f"{what}: tokens must be integers >= 1, got {k!r}")
        out[k] = _number(t, k, f"{where}: {what}", float, 1e-12)
    return dict(sorted(out.items()))


def _draft_collectives(d: dict, where: str) -> int:
    """draft_collectives, or an old profile's draft_allreduces (the same count under its first
    name); 0 when neither is given; both must agree."""
    new = _number(d, "draft_collectives", where, int) if "draft_collectives" in d else None
    old = _number(d, "draft_allreduces", where, int) if "draft_allreduces" in d else None
    _check(new is None or old is None or new == old, where,
           f"draft_collectives ({new}) and its old name draft_allreduces ({old}) disagree")
    return new if new is not None else (old or 0)


def profile_from_dict(d: dict, where: str = "profile") -> NodeProfile:
    """A parsed YAML mapping -> NodeProfile, or ValueError naming `where` and the field."""
    _check(isinstance(d, dict), where, "a profile must be a YAML mapping")
    known = {f.name for f in dataclasses.fields(NodeProfile) if f.init} | {"draft_allreduces"}
    unknown = sorted(set(d) - known)
    _check(not unknown, where, f"unknown field(s) {unknown} (known: {sorted(known)})")
    _check("name" in d, where, "missing field 'name'")
    gpus = _number(d, "gpus", where, int, 1)
    _check("interconnect" in d, where, "missing field 'interconnect'")
    ic, w = d["interconnect"], f"{where}: interconnect"
    _check(isinstance(ic, dict), where, "field 'interconnect' must be a mapping")
    ic_known = {f.name for f in dataclasses.fields(Interconnect)}
    _check(not set(ic) - ic_known, w, f"unknown field(s) {sorted(set(ic) - ic_known)}")
    inter = Interconnect(
        latency_us=_number(ic, "latency_us", w),
        bandwidth_gbps=_number(ic, "bandwidth_gbps", w, float, 1e-9),
        allreduces_per_forward=_number(ic, "allreduces_per_forward", w, int),
        hidden_size=_number(ic, "hidden_size", w, int, 1),
        bytes_per_elem=_number(ic, "bytes_per_elem", w, int, 1),
        allreduce_us=_curve(ic.get("allreduce_us"), f"{w}: allreduce_us"))
    _check("verify_ms" in d, where, "missing field 'verify_ms'")
    verify_ms = _ms_table(d["verify_ms"], where, "verify_ms")
    par = d.get("draft_parallel_ms")
    block, block_layers = _draft_block(d, where)
    surface = _surface(d.get("verify_batch_ms"), where)
    rounds, plain = _engine_rounds(d, where)
    sources = d.get("sources", [])
    _check(isinstance(sources, list) and all(isinstance(s, str) for s in sources), where,
           "field 'sources' must be a list of strings")
    return NodeProfile(
        name=str(d["name"]), description=str(d.get("description", "")), sources=sources,
        gpus=gpus, interconnect=inter, verify_ms=verify_ms,
        draft_step_ms=_number(d, "draft_step_ms", where, float, 1e-12),
        draft_collectives=_draft_collectives(d, where),
        draft_parallel_ms=None if par is None else _ms_table(par, where, "draft_parallel_ms"),
        simulated=bool(d.get("simulated", False)),
        draft_layer=str(d.get("draft_layer", "llama")), draft_layers=_draft_layers(d, where),
        draft_block_ms=block, draft_block_layers=block_layers, verify_batch_ms=surface,
        round_batch_ms=rounds, plain_batch_ms=plain,
        round_engine=None if d.get("round_engine") is None else str(d["round_engine"]))


def _surface(raw, where: str) -> dict[int, dict[int, float]] | None:
    """verify_batch_ms: None, or batch sizes (integers >= 1) -> a verify table of their own
    (tokens per sequence -> ms), with at least one batch size above 1."""
    if raw is None:
        return None
    _check(isinstance(raw, dict) and raw, where, "field 'verify_batch_ms' must be a non-empty "
                                                 "mapping batch size -> {tokens -> ms}")
    out = {}
    for b, row in raw.items():
        _check(isinstance(b, int) and not isinstance(b, bool) and b >= 1, where,
               f"verify_batch_ms: batch sizes must be integers >= 1, got {b!r}")
        out[b] = _ms_table(row, where, f"verify_batch_ms.{b}")
    _check(max(out) >= 2, where, "verify_batch_ms needs a batch size above 1")
    return dict(sorted(out.items()))


def _engine_rounds(d: dict, where: str) -> tuple[dict | None, dict | None]:
    """round_batch_ms (depth k >= 0 -> {batch -> ms}) and plain_batch_ms (batch -> ms): both or
    neither, the same batch sizes in every row."""
    rounds, plain = d.get("round_batch_ms"), d.get("plain_batch_ms")
    if rounds is None and plain is None:
        return None, None
    _check(rounds is not None and plain is not None, where, "round_batch_ms and plain_batch_ms "
           "come together (`eagle3-ray profile --engine vllm` measures both)")
    _check(isinstance(rounds, dict) and rounds, where, "field 'round_batch_ms' must be a "
                                                       "non-empty mapping depth -> {batch -> ms}")
    out = {}
    for k, row in rounds.items():
        _check(isinstance(k, int) and not isinstance(k, bool) and k >= 0, where,
               f"round_batch_ms: depths must be integers >= 0, got {k!r}")
        out[k] = _ms_table(row, where, f"round_batch_ms.{k}")
    plain = _ms_table(plain, where, "plain_batch_ms")
    for k, row in out.items():
        _check(sorted(row) == sorted(plain), where, f"round_batch_ms.{k} has batch sizes "
               f"{sorted(row)}, plain_batch_ms {sorted(plain)}: measure them together")
    return dict(sorted(out.items())), plain


def _draft_block(d: dict, where: str) -> tuple[dict[int, float] | None, int | None]:
    """draft_block_ms and draft_block_layers, both or neither: a block drafter's forward time
    means nothing without the layer count it was measured with."""
    has_ms, has_layers = d.get("draft_block_ms") is not None, "draft_block_layers" in d
    _check(has_ms == has_layers, where, "draft_block_ms and draft_block_layers (the layer count "
                                        "of the block drafter it was measured with) go together")
    if not has_ms:
        return None, None
    return (_ms_table(d["draft_block_ms"], where, "draft_block_ms"),
            _number(d, "draft_block_layers", where, int, 1))


def _draft_layers(d: dict, where: str) -> dict[str, dict] | None:
    """A profile's `draft_layers`: {shape: {draft_step_ms, draft_collectives[,
    draft_parallel_ms][, draft_block_ms, draft_block_layers]}}, each checked as the top-level
    fields are."""
    raw = d.get("draft_layers")
    if raw is None:
        return None
    _check(isinstance(raw, dict), where, "field 'draft_layers' must be a mapping")
    out = {}
    for shape, e in raw.items():
        w = f"{where}: draft_layers.{shape}"
        _check(isinstance(e, dict), w, "must be a mapping")
        par = e.get("draft_parallel_ms")
        out[str(shape)] = {
            "draft_step_ms": _number(e, "draft_step_ms", w, float, 1e-12),
            "draft_collectives": _number(e, "draft_collectives", w, int),
            "draft_parallel_ms": None if par is None else _ms_table(par, w, "draft_parallel_ms")}
        block, layers = _draft_block(e, w)
        if block is not None:
            out[str(shape)].update(draft_block_ms=block, draft_block_layers=layers)
    return out


def with_draft_layer(p: NodeProfile, layer: str | None) -> NodeProfile:
    """`p` pricing a drafter whose decoder layer is `layer` ("llama", "mla"; None: as is): an
    MLA layer reads other weights than a Llama one (q/kv LoRA projections, replicated across
    the tensor-parallel GPUs where the engines do not split them), so its forward costs
    differently; its collectives are counted in the profile too. Refuses a shape the profile
    does not price."""
    if layer is None or layer == p.draft_layer:
        return p
    entry = (p.draft_layers or {}).get(layer)
    if entry is None:
        raise ValueError(f"profile {p.name}: prices drafter layer {p.draft_layer!r} and "
                         f"{sorted(p.draft_layers or {})}, not {layer!r}: add draft_layers."
                         f"{layer} (draft_step_ms, draft_collectives) to it")
    here = {"draft_step_ms": p.draft_step_ms, "draft_collectives": p.draft_collectives,
            "draft_parallel_ms": p.draft_parallel_ms}
    if p.draft_block_ms is not None:
        here.update(draft_block_ms=p.draft_block_ms, draft_block_layers=p.draft_block_layers)
    others = {p.draft_layer: here, **{k: v for k, v in p.draft_layers.items() if k != layer}}
    return dataclasses.replace(p, draft_layer=layer, draft_layers=others,
                               **{"draft_block_ms": None, "draft_block_layers": None, **entry})


def profile_path(name_or_path: str) -> str:
    """A path as is; a bare name -> the packaged eagle3_ray/plan/profiles/<name>.yaml."""
    if os.sep in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        return name_or_path
    return os.path.join(PROFILE_DIR, f"{name_or_path}.yaml")


def packaged_profiles() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".yaml"))


def load_profile(name_or_path: str) -> NodeProfile:
    import yaml
    path = profile_path(name_or_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"profile not found: {path} (packaged: {packaged_profiles()})")
    with open(path) as f:
        try:
            d = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
    return profile_from_dict(d, path)


def profile_to_dict(p: NodeProfile) -> dict:
    d = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}
    d["interconnect"] = dataclasses.asdict(p.interconnect)
    if p.interconnect.allreduce_us is None:
        del d["interconnect"]["allreduce_us"]                 # α/β profiles stay as they were
    else:
        d["interconnect"]["allreduce_us"] = {int(k): float(v) for k, v in
                                             sorted(p.interconnect.allreduce_us.items())}
    d["verify_ms"] = {int(k): float(v) for k, v in sorted(p.verify_ms.items())}
    if p.draft_parallel_ms is None:
        del d["draft_parallel_ms"]                              # not measured: modelled flat
    else:
        d["draft_parallel_ms"] = {int(k): float(v) for k, v in sorted(p.draft_parallel_ms.items())}
    if p.draft_block_ms is None:
        del d["draft_block_ms"], d["draft_block_layers"]       # not measured: modelled
    else:
        d["draft_block_ms"] = {int(k): float(v) for k, v in sorted(p.draft_block_ms.items())}
    if p.verify_batch_ms is None:
        del d["verify_batch_ms"]                               # batch 1 only
    else:
        d["verify_batch_ms"] = {int(b): {int(k): float(v) for k, v in sorted(row.items())}
                                for b, row in sorted(p.verify_batch_ms.items())}
    if p.round_batch_ms is None:
        del d["round_batch_ms"], d["plain_batch_ms"], d["round_engine"]
    else:
        d["round_batch_ms"] = {int(k): {int(b): float(v) for b, v in sorted(row.items())}
                               for k, row in sorted(p.round_batch_ms.items())}
        d["plain_batch_ms"] = {int(b): float(v) for b, v in sorted(p.plain_batch_ms.items())}
    return d


def save_profile(profile: NodeProfile, path: str) -> None:
    import yaml
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(profile_to_dict(profile), f, sort_keys=False)


def with_interconnect(measured: NodeProfile, node: NodeProfile) -> NodeProfile:
    """`measured`'s compute times with `node`'s GPUs and interconnect, labelled a simulation:
    what this machine's verifier would cost if every forward also paid `node`'s all-reduces."""
    return dataclasses.replace(
        measured, name=f"{measured.name}+{node.name}-interconnect", simulated=True,
        gpus=node.gpus, interconnect=dataclasses.replace(node.interconnect),
        description=f"SIMULATION: compute of {measured.name}, interconnect of {node.name}",
        sources=measured.sources + [f"interconnect: {node.name}"] + node.sources)



def message_bytes(profile: NodeProfile, tokens: int) -> int:
    """Bytes of one all-reduce of a verifier forward over `tokens` tokens: tokens·H·B."""
    return tokens * profile.interconnect.hidden_size * profile.interconnect.bytes_per_elem


# --- measuring this machine ------------------------------------------------------------------

# Verify sizes whose all-reduce `profile` times: depths 0, 1, 2, 4, 8, 16, 32.
CURVE_TOKENS = (1, 2, 3, 5, 9, 17, 33)


def _allreduce_worker(rank: int, world: int, sizes: list[int], port: int, out: str,
                      backend: str, iters: int) -> None:
    import time
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    dtype = torch.bfloat16 if cuda else torch.float32            # gloo: fp32 sums
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res = {}
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // dtype.itemsize), dtype=dtype,
                       device="cuda" if cuda else "cpu")          # [bytes / itemsize]
        for _ in range(max(5, iters // 10)):                      # warm-up
            dist.all_reduce(x)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        sync()
        res[nbytes] = (time.perf_counter() - t0) / iters * 1e6    # µs per all-reduce
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def measure_allreduce_curve(procs: int, sizes, backend: str = "nccl",
                            iters: int = 200) -> dict[int, float]:
    """{message bytes: µs of one all-reduce} across `procs` spawned processes: NCCL with one
    GPU each (bf16), or gloo between CPU processes (fp32; how the tests run this code)."""
    import socket
    import tempfile
    import torch.multiprocessing as mp
    sizes = sorted({int(b) for b in sizes})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "allreduce.json")
        mp.spawn(_allreduce_worker, args=(procs, sizes, port, out, backend, iters),
                 nprocs=procs, join=True)
        return {int(k): round(v, 3) for k, v in json.load(open(out)).items()}



def _ls_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 when the xs do not vary)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0



def fit_alpha_beta(curve: dict[int, float], gpus: int) -> tuple[float, float]:
    """(α µs, BW GB/s) of t = α + 2(n−1)/n · bytes / BW fitted to a curve by least squares:
    the fallback a profile keeps next to its curve. A curve that does not grow with the
    message (noise) gets α = its smallest time and BW as if its largest time were transfer.
    Both to 4 significant digits (a slow, noisy link's BW is far below 0.001 GB/s)."""
    c = 2 * (gpus - 1) / gpus
    xs, ys = [c * b for b in curve], list(curve.values())                 # bytes, µs
    slope = _ls_slope(xs, ys)                                              # µs/B
    if slope <= 0:
        alpha, bw = min(ys), max(xs) / (max(ys) * 1e-6) / 1e9
    else:
        alpha = max(0.0, sum(ys) / len(ys) - slope * sum(xs) / len(xs))
        bw = 1e6 / slope / 1e9
    return float(f"{alpha:.4g}"), float(f"{bw:.4g}")


def add_allreduce_curve(profile: NodeProfile, procs: int, allreduces_per_forward: int,
                        backend: str = "nccl", iters: int = 200) -> NodeProfile:
    """`profile` on `procs` devices: its all-reduce curve measured at the message sizes of
    verifies of CURVE_TOKENS tokens (tokens·H·B bytes), α/β fitted to it as the fallback, and
    `allreduces_per_forward` all-reduces per verifier forward."""
    sizes = [message_bytes(profile, t) for t in CURVE_TOKENS]
    curve = measure_allreduce_curve(procs, sizes, backend, iters)
    alpha, bw = fit_alpha_beta(curve, procs)
    return dataclasses.replace(
        profile, gpus=procs, interconnect=dataclasses.replace(
            profile.interconnect, latency_us=alpha, bandwidth_gbps=bw,
            allreduces_per_forward=allreduces_per_forward, allreduce_us=curve))


def monotone_curve(verify_ms: dict[int, float]) -> dict[int, float]:
    """The least-squares non-decreasing fit of a measured verify curve (isotonic regression,
    pool adjacent violators): verifying more tokens never costs less, so a point below an
    earlier one is noise, and it is averaged with its neighbours instead of making the deeper
    depths look free. A curve that already rises is returned as it is; steps (a kernel switch
    between 2 and 3 rows) are kept, which a fitted line or hinge would smooth away (measured:
    docs/benchmarks.md, "Verify cost")."""
    blocks: list[list[float]] = []                       # [sum, count] of pooled points
    for k in sorted(verify_ms):
        blocks.append([verify_ms[k], 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    ys = [total / n for total, n in blocks for _ in range(n)]
    return dict(zip(sorted(verify_ms), ys))


def single_device_profile(name: str, verify_ms: dict[int, float], draft_ms: float, config,
                          dtype=None, description: str = "",
                          draft_parallel_ms: dict[int, float] | None = None,
                          verify_batch_ms: dict[int, dict[int, float]] | None = None
                          ) -> NodeProfile:
    """Measured times of one device (no interconnect, no drafter collectives) -> a NodeProfile,
    its verify curve and k-token drafter forward times made non-decreasing (monotone_curve)."""
    import time
    import torch
    itemsize = dtype.itemsize if dtype is not None else 2
    return NodeProfile(
        name=name, description=description or f"measured: {name}",
        sources=[f"measured {time.strftime('%Y-%m-%d')} with torch {torch.__version__}"],
        gpus=1, interconnect=Interconnect(latency_us=0.0, bandwidth_gbps=1.0,
                                          allreduces_per_forward=0,
                                          hidden_size=config.hidden_size, bytes_per_elem=itemsize),
        verify_ms={k: round(v, 4) for k, v in monotone_curve(verify_ms).items()},
        draft_step_ms=round(draft_ms, 4),
        draft_parallel_ms=({k: round(v, 4) for k, v in monotone_curve(draft_parallel_ms).items()}
                           if draft_parallel_ms else None),
        verify_batch_ms=({b: {k: round(v, 4) for k, v in monotone_curve(row).items()}
                          for b, row in sorted(verify_batch_ms.items())}
                         if verify_batch_ms else None))
