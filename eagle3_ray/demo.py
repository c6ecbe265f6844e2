"""The end-to-end demo on the embedded default: extract -> train -> serve -> HTTP requests -> report.

All artifacts go to one run directory (data/, train/, report.json, report.png). Extraction and
training resume, so a rerun reuses finished stages; `fresh` starts over. The serving stage
deploys the Ray Serve app (serve/app.py) with the trained drafter and dynamic depth, sends the same
held-out prompts greedily at depth 0, at the drafter's depth and with no depth (the planner picks
each round's depth from this replica's measured costs) through HTTP (interleaved, one at a time),
and reports per-position acceptance (from the server's /metrics), acceptance length, tokens/s
of each arm, and whether the outputs are identical. The server runs with its defaults, the
lookup fallback included: acceptance counts every verify round, the lookup's too.

The three stages aim at `minutes` (22) in all: a short probe of the verifier's speed here
(plan_for_host) decides how many conversations extraction can take in its share and how many
prompts the serve stage can send in its own, and training gets what is left (at most its
400 steps or 15 minutes). A bf16 host and an emulated AVX2 one keep the defaults; a slower one
scales them down, and the report says what it scaled.

    eagle3-ray demo --samples 32 --train-steps 20 --prompts 2     # a quick CPU run
"""
import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, replace

from eagle3_ray.engine import hf as verifier


@dataclass
class DemoConfig:
    run_dir: str = "runs/demo"
    minutes: float = 22.0                 # wall-clock target of the three stages: a host too
                                          # slow for the defaults in it extracts fewer
                                          # conversations, trains for less time and sends fewer
                                          # prompts (plan_for_host; the report says what it
                                          # scaled and why); 0: the defaults as they are
    samples: int | None = None            # conversations to extract; None: 400, or fewer where
                                          # the host could not extract them in its share
    max_length: int = 512                 # tokens per sample
    regenerate: bool = False              # train on the verifier's own greedy answers: served
                                          # tau(4) 1.52-1.59 (two runs) vs 1.47 on a fast host,
                                          # x5 the extraction time (docs/benchmarks.md, "Demo")
    regen_max_new_tokens: int = 256       # tokens per regenerated assistant turn
    ttt_steps: int = 4
    train_steps: int = 400                # the drafter's optimizer steps, the same on every
                                          # host: a bf16 host (AVX512-BF16/AMX) takes ~6-9 minutes
                                          # for them, an fp32 one (AVX2-only) ~13 (docs/benchmarks.md)
    train_minutes: float = 15.0           # wall-clock cap on training (a slow host stops
                                          # there with fewer steps; the lr schedule follows
                                          # whichever budget runs out first)
    depth: int = 0                        # served depth; 0 = the drafter's ttt_steps
    prompts: int | None = None            # held-out prompts sent at each depth; None: 12
                                          # (ratios to about ±0.1 on a noisy 2-core host; 6 gave
                                          # ±0.15), or fewer (at least 6) on a slow host
    max_tokens: int = 48                  # tokens per reply
    fresh: bool = False
    address: str | None = None


# The demo's defaults and what its stages cost, for plan_for_host. Measured on the hosts of
# docs/benchmarks.md ("Demo"): stage speeds as multiples of probe_host's readings.
DEFAULT_SAMPLES, MIN_SAMPLES = 400, 96
DEFAULT_PROMPTS, MIN_PROMPTS = 12, 6
TOKENS_PER_SAMPLE = 421        # mean tokens of an embedded ShareGPT conversation cut to 512
EXTRACT_PER_PROBE = 0.9        # the demo's extraction tokens/s / the probe's forward tokens/s
                               # (0.97 emulated AVX2, 0.8x bf16 here; 0.55 on issue 48's host
                               # against its transformers loop: training absorbs an overrun)
SERVE_PER_PROBE = {"bfloat16": 0.6, "float32": 1.1}  # served depth-0 tokens/s over HTTP / the
                               # probe's decode tokens/s (fp32 serving runs the few-row kernels
                               # it timed, faster than the probe's plain forward)
SERVE_START_S = 60             # Serve up: replica, verifier, kernel timing, exactness check
TRAIN_START_S = 45             # Ray Train up to its first step (2 workers)
EXTRACT_SHARE = 0.3            # of the budget, at most, for extraction: the drafter is
                               # compute-bound, so a slow host gives training the most
SERVE_SHARE = 0.15             # of the budget, at most, for the prompts


def probe_host(spec: str = verifier.EMBEDDED_VERIFIER) -> dict:
    """The verifier's speed on this host, in the dtype and threads the stages use: forward
    tokens/s on a [1, 512] batch as extraction runs it, and decode tokens/s (one-token forwards
    after a 64-token cache). ~5 s on a bf16 host, ~15 s on a slow fp32 one."""
    import torch
    from transformers import DynamicCache
    torch.set_num_threads(os.cpu_count() or 1)
    model = verifier.load_verifier(spec)
    text = verifier.text_config(model.config)
    layers = verifier.default_aux_layer_ids(text.num_hidden_layers)
    ids = torch.arange(512)[None] % text.vocab_size                  # [1, 512]
    mask = torch.ones_like(ids)
    verifier.forward_hidden(model, ids[:, :64], mask[:, :64], layers)        # warm-up
    t0 = time.perf_counter()
    for _ in range(2):
        verifier.forward_hidden(model, ids, mask, layers)
    forward = 2 * ids.shape[1] / (time.perf_counter() - t0)
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=ids[:, :64], cache=cache, use_cache=True)
        model(input_ids=ids[:, 64:65], cache=cache, use_cache=True)          # warm-up
        t0 = time.perf_counter()
        for i in range(65, 81):
            model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True)
        decode = 16 / (time.perf_counter() - t0)
    return {"dtype": str(model.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "forward_tokens_per_s": forward, "decode_tokens_per_s": decode}


def serve_seconds(prompts: int, max_tokens: int, probe: dict) -> float:
    """The serve stage's expected wall time: start-up, then (prompts + a warm-up) x 3 arms of
    max_tokens each, depth 0 at SERVE_PER_PROBE x the probe's decode speed and the two
    speculative arms ~1.3x faster."""
    rate = SERVE_PER_PROBE.get(probe["dtype"], 0.6) * probe["decode_tokens_per_s"]
    return SERVE_START_S + (prompts + 1) * max_tokens * (1 + 2 / 1.3) / rate


def plan_for_host(cfg: DemoConfig, probe: dict) -> tuple[DemoConfig, dict]:
    """cfg with the samples and prompts it left open (None) sized to this host so that the
    three stages fit cfg.minutes: extraction takes at most EXTRACT_SHARE of them, the prompts
    SERVE_SHARE, and training what is left (train_budget_minutes, after extraction). A fast
    host keeps the defaults. -> (cfg, the plan for the report)."""
    budget = cfg.minutes * 60
    samples, prompts = cfg.samples or DEFAULT_SAMPLES, cfg.prompts or DEFAULT_PROMPTS
    extract_rate = EXTRACT_PER_PROBE * probe["forward_tokens_per_s"]
    if cfg.samples is None and budget:
        fit = int(EXTRACT_SHARE * budget * extract_rate / TOKENS_PER_SAMPLE)
        if fit < 0.9 * DEFAULT_SAMPLES:   # within 10%: the minutes are approximate anyway
            samples = max(MIN_SAMPLES, fit)
    if cfg.prompts is None and budget:
        while prompts > MIN_PROMPTS and serve_seconds(
                prompts, cfg.max_tokens, probe) - SERVE_START_S > SERVE_SHARE * budget:
            prompts -= 1
    plan = {"minutes": cfg.minutes, "probe": probe, "samples": samples, "prompts": prompts,
            "expected_extract_s": samples * TOKENS_PER_SAMPLE / extract_rate,
            "expected_serve_s": serve_seconds(prompts, cfg.max_tokens, probe),
            "scaled": [k for k, v, d in (("samples", samples, DEFAULT_SAMPLES),
                                         ("prompts", prompts, DEFAULT_PROMPTS))
                       if getattr(cfg, k) is None and v < d]}
    return replace(cfg, samples=samples, prompts=prompts), plan


def train_budget_minutes(cfg: DemoConfig, plan: dict, elapsed_s: float) -> float:
    """Training's wall-clock cap: cfg.train_minutes, or less where the budget left after
    `elapsed_s` (the probe and extraction) and the serve stage's share is shorter (at least 2)."""
    if not cfg.minutes:
        return cfg.train_minutes
    left = cfg.minutes * 60 - elapsed_s - plan["expected_serve_s"] - TRAIN_START_S
    return round(min(cfg.train_minutes, max(2.0, left / 60)), 2)


def run_demo(cfg: DemoConfig) -> dict:
    from eagle3_ray.data import schema
    from eagle3_ray.extract.pipeline import ExtractConfig, run_extract
    from eagle3_ray.train.config import TrainConfig
    from eagle3_ray.train.trainer import run_train
    if cfg.fresh and os.path.isdir(cfg.run_dir):
        shutil.rmtree(cfg.run_dir)
    t0 = time.perf_counter()
    data_dir, train_dir = (os.path.join(cfg.run_dir, d) for d in ("data", "train"))
    if cfg.samples is None and os.path.isfile(os.path.join(data_dir, "manifest.json")):
        done = schema.read_manifest(data_dir)["config"]["sample_limit"]   # a rerun: the same
        cfg = replace(cfg, samples=done)
    cfg, plan = plan_for_host(cfg, probe_host())
    tp = time.perf_counter()
    if plan["scaled"]:
        print(f"[demo] this host runs the verifier at {plan['probe']['forward_tokens_per_s']:.0f}"
              f" tokens/s ({plan['probe']['dtype']}): {cfg.samples} conversations and "
              f"{cfg.prompts} prompts per depth, so that the demo fits ~{cfg.minutes:g} minutes")
    run_extract(ExtractConfig(output=data_dir, sample_limit=cfg.samples,
                              max_length=cfg.max_length, batch_rows=32,
                              regenerate=cfg.regenerate,
                              regen_max_new_tokens=cfg.regen_max_new_tokens), cfg.address)
    t1 = time.perf_counter()
    plan["train_minutes"] = train_budget_minutes(cfg, plan, t1 - t0)
    if not os.path.isfile(os.path.join(train_dir, "drafter", "meta.json")):
        run_train(TrainConfig(      # the recipe is TrainConfig's default (docs/benchmarks.md)
            dataset=data_dir, output=train_dir, ttt_steps=cfg.ttt_steps, max_steps=cfg.train_steps,
            max_minutes=plan["train_minutes"], max_seq_len=cfg.max_length, eval_every=0,
            log_every=25, checkpoint_every=100, num_workers=2, cpus_per_worker=0.5), cfg.address)
    t2 = time.perf_counter()
    report = serve_and_measure(cfg, os.path.join(train_dir, "drafter"))
    report["plan"] = plan
    report["wall_s"] = {"probe": tp - t0, "extract": t1 - tp, "train": t2 - t1,
                        "serve": time.perf_counter() - t2, "total": time.perf_counter() - t0}
    with open(os.path.join(cfg.run_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot_report(report, os.path.join(cfg.run_dir, "report.png"))
    print_report(report, cfg.run_dir)
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_measure(cfg: DemoConfig, drafter_dir: str) -> dict:
    import requests
    from ray import serve as ray_serve
    from eagle3_ray.bench import stages as bench
    from eagle3_ray.data import conversations as data
    from eagle3_ray.serve import app as serve
    meta = json.load(open(os.path.join(drafter_dir, "meta.json")))
    depth = cfg.depth or meta["ttt_steps"]
    scfg = serve.ServeConfig(drafter=drafter_dir, depth=depth, max_depth=max(16, depth),
                             dynamic_depth=True, cpus_per_replica=1, torch_threads=2,
                             port=_free_port(), max_model_len=2048)
    url = serve.start(scfg, cfg.address, name="demo")
    try:
        tok = verifier.load_tokenizer(scfg.verifier)
        prompts = [tok.decode(p) for p in data.heldout_prompts(tok, cfg.prompts + 1)]
        arms = [0, depth, "dynamic"]                  # "dynamic": no speculation_depth sent
        runs = {d: [] for d in arms}
        for i, prompt in enumerate(prompts):          # prompt 0 warms the replica up
            for d in arms[i % 3:] + arms[:i % 3]:     # rotating order: noise hits all arms
                body = {"model": scfg.model_name, "prompt": prompt,
                        "max_tokens": cfg.max_tokens, "temperature": 0}
                if d != "dynamic":
                    body["speculation_depth"] = d
                t0 = time.perf_counter()
                r = requests.post(f"{url}/v1/completions", timeout=600, json=body)
                r.raise_for_status()
                if i:
                    runs[d].append((r.json(), time.perf_counter() - t0))
        m = serve.parse_metrics(requests.get(f"{url}/metrics", timeout=60).text)
    finally:
        ray_serve.delete("demo")
    report = {"drafter": drafter_dir, "ttt_steps": meta["ttt_steps"], "depth": depth,
              "train_steps": meta["steps"], "url": url, "prompts": len(prompts) - 1,
              "max_tokens": cfg.max_tokens, "host": bench.host_flags(),
              "heldout_eval": {k: v for k, v in meta["final_metrics"].items()
                               if k.startswith("eval/")}}
    for d, rs in runs.items():
        tokens = sum(b["usage"]["completion_tokens"] for b, _ in rs)
        wall = sum(w for _, w in rs)
        spec = [b["usage"]["speculation"] for b, _ in rs]
        rounds = sum(s["rounds"] for s in spec)
        report[f"depth_{d}"] = {
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "acceptance_length": (sum(s["accepted_tokens"] for s in spec) + rounds) / max(1, rounds),
            "mean_depth": sum(s["drafted_tokens"] for s in spec) / max(1, rounds),
            "lookup_rounds": sum(s["lookup_rounds"] for s in spec)}   # serve's lookup fallback
    base = report["depth_0"]["tokens_per_s"]
    report["speedup"] = report[f"depth_{depth}"]["tokens_per_s"] / base
    report["speedup_dynamic"] = report["depth_dynamic"]["tokens_per_s"] / base
    texts = {d: [b["choices"][0]["text"] for b, _ in rs] for d, rs in runs.items()}
    report["identical_outputs"] = texts[0] == texts[depth] == texts["dynamic"]
    # per-position acceptance over every request this server answered (warm-up included)
    report["acceptance_by_position"] = [
        m.get(f'eagle3_ray_accepted_at_position_total{{position="{k}"}}', 0)
        / max(1, m.get(f'eagle3_ray_drafted_at_position_total{{position="{k}"}}', 0))
        for k in range(depth)]
    report["few_row_kernels"] = replica_kernels(m)    # what the replica timed (fp32; bf16: none)
    report["sample_output"] = runs[depth][0][0]["choices"][0]["text"] if runs[depth] else ""
    return report


def replica_kernels(metrics: dict[str, float]) -> dict[str, str]:
    """A replica's parsed /metrics -> the fp32 kernel it timed fastest per row count
    ({"1": "linear", ...}; empty in bf16, where one batch-invariant kernel runs every count)."""
    found = (re.fullmatch(r'eagle3_ray_fp32_kernel_info\{rows="(\d+)",kernel="([^"]+)"\}', k)
             for k in metrics)
    return dict(sorted((g.groups() for g in found if g), key=lambda rk: int(rk[0])))


def print_report(r: dict, run_dir: str) -> None:
    d = r["depth"]
    print(f"\n[demo] drafter {r['drafter']} (ttt_steps={r['ttt_steps']}, {r['train_steps']} steps)"
          f"; host CPU flags: {' '.join(r.get('host', [])) or '-'}")
    print("[demo] served acceptance by position (accepted / drafted): " + ", ".join(
        f"{k}: {a:.2f}" for k, a in enumerate(r["acceptance_by_position"])))
    print(f"[demo] acceptance length at depth {d}: {r[f'depth_{d}']['acceptance_length']:.2f} "
          f"tokens per verify round")
    dyn = r["depth_dynamic"]
    print(f"[demo] tokens/s over HTTP: depth 0 {r['depth_0']['tokens_per_s']:.1f}, depth {d} "
          f"{r[f'depth_{d}']['tokens_per_s']:.1f} (x{r['speedup']:.2f}), dynamic depth "
          f"{dyn['tokens_per_s']:.1f} (x{r['speedup_dynamic']:.2f}, mean depth "
          f"{dyn['mean_depth']:.1f}); greedy outputs identical: {r['identical_outputs']}")
    looked = ", ".join(f"{k.removeprefix('depth_')} {v['lookup_rounds']}" for k, v in r.items()
                       if k.startswith("depth_") and isinstance(v, dict) and "lookup_rounds" in v)
    print(f"[demo] rounds drafted by the lookup fallback: {looked}")
    if r.get("few_row_kernels"):
        print(f"[demo] fp32 kernels the replica timed fastest, by rows: {r['few_row_kernels']}")
    p = r.get("plan", {})
    if p.get("scaled"):
        print(f"[demo] scaled to this host ({p['probe']['forward_tokens_per_s']:.0f} forward "
              f"tokens/s, {p['probe']['dtype']}) to fit ~{p['minutes']:g} minutes: "
              f"{p['samples']} conversations (of {DEFAULT_SAMPLES}), {p['prompts']} prompts per "
              f"depth (of {DEFAULT_PROMPTS}), training capped at {p['train_minutes']:g} minutes")
    w = r["wall_s"]
    print(f"[demo] wall: probe {w.get('probe', 0):.0f}s, extract {w['extract']:.0f}s, train "
          f"{w['train']:.0f}s, serve {w['serve']:.0f}s, total {w['total'] / 60:.1f} minutes; "
          f"report: {run_dir}/report.json, {run_dir}/report.png")


def plot_report(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    d = r["depth"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    acc = r["acceptance_by_position"]
    a1.bar(range(len(acc)), acc, color="#37a")
    a1.set_xlabel("draft position"), a1.set_ylabel("accepted / drafted"), a1.set_ylim(0, 1)
    a1.set_title(f"served acceptance, depth {d}")
    tps = [r[f"depth_{k}"]["tokens_per_s"] for k in (0, d, "dynamic")]
    names = ["depth 0", f"depth {d}", f"dynamic\n(mean {r['depth_dynamic']['mean_depth']:.1f})"]
    a2.bar(names, tps, color=["#999", "#a52", "#3a7"])
    a2.set_ylabel("tokens/s (HTTP, greedy)")
    a2.set_title(f"x{r['speedup']:.2f} / x{r['speedup_dynamic']:.2f} dynamic, "
                 f"identical: {r['identical_outputs']}")
    fig.suptitle(f"host: {' '.join(r.get('host', [])) or '-'}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
