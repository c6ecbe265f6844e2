"""Benchmark: the cost of one speculation round on this CPU, for two versions of the code side
by side — a verifier forward over 1, 2, 3, 4, 5, 8, 12, 17 tokens after a 256-token KV cache
(the Speculator's own `_verify`, aux-state hooks included, as profile.measure_speculator times
it) and one drafter step (draft vocab 8192) — on this host and on an emulated AVX2-only host
(`EAGLE3_RAY_NATIVE_BF16=0` with ATen/MKL/oneDNN capped at AVX2: an fp32 verifier).

"before" is a git ref (its `eagle3_ray/` is extracted to a temporary directory), "after" the
working tree. Each measurement runs in its own process (the ISA caps must be set before torch
loads); the processes alternate before/after and host kinds for `--rounds` rounds, so slow
drift and other load on a shared machine hit both versions alike. Reported: medians of wall
and of thread CPU time (one torch thread: CPU time is what other processes on the same cores
disturb least), and the median over rounds of each round's after/before ratio.

    python -m eagle3_ray.bench.verify_cost --before HEAD --rounds 4    # -> runs/bench/verify-cost.*
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TOKENS = (1, 2, 3, 4, 5, 8, 12, 17)
EMULATED_AVX2 = {"EAGLE3_RAY_NATIVE_BF16": "0", "ATEN_CPU_CAPABILITY": "avx2",
                 "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
HOSTS = {"native": {}, "emulated-avx2": EMULATED_AVX2}
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # holds eagle3_ray/


def measure(tokens=TOKENS, context: int = 256, reps: int = 5, draft_vocab: int = 8192,
            spec: str | None = None) -> dict:
    """In this process: the Speculator's verify over each token count after a `context`-token
    cache, interleaved over `reps` rounds, and 4·reps drafter steps -> raw samples (ms)."""
    import torch
    from transformers import DynamicCache
    drafters, speculate, verifier = _code_modules()
    spec = spec or verifier.EMBEDDED_VERIFIER
    model = verifier.load_verifier(spec)
    drafter = drafters.untrained_drafter(spec, draft_vocab)[0]
    dec = speculate.Speculator(model, drafter.eval())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.get_text_config(decoder=True).vocab_size, (context + max(tokens) + 1,),
                        generator=g).tolist()
    wall = {t: [] for t in tokens}
    cpu = {t: [] for t in tokens}
    draft_wall, draft_cpu = [], []

    def timed(fn, w, c):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        w.append((time.perf_counter() - t0) * 1e3)
        c.append((time.thread_time() - c0) * 1e3)

    with torch.inference_mode():
        cache = DynamicCache()
        _, aux = dec._verify(ids[:context], cache)                     # aux [1, ctx, 3H]
        kv = speculate.DraftKV()
        h, logits_d = dec._draft_step(ids[1:context + 1], aux, kv)    # absorb the context
        tok = int(drafter.draft_to_target(logits_d.argmax()))

        def verify(t):
            dec._verify(ids[context:context + t], cache)
            cache.crop(-t)                                             # back to the context

        def draft_one():
            _, lg = dec._draft_step([tok], h, kv)
            int(lg.argmax())
            kv.crop(context)

        for r in range(reps + 1):                                      # round 0: warm-up
            for t in tokens:
                timed(lambda: verify(t), wall[t], cpu[t])
            for _ in range(4):
                timed(draft_one, draft_wall, draft_cpu)
            if r == 0:
                for x in [*wall.values(), *cpu.values(), draft_wall, draft_cpu]:
                    x.clear()
    return {"dtype": str(model.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
            "code": os.path.dirname(speculate.__file__),
            "verify_wall_ms": wall, "verify_cpu_ms": cpu,
            "draft_wall_ms": draft_wall, "draft_cpu_ms": draft_cpu}


def _code_modules():
    """(the module with untrained_drafter, speculate, verifier) of the source tree measured:
    its stage packages (train.kinds, or train.draft before kinds existed), or the flat modules
    of a tree from before they existed (--before REF)."""
    import importlib
    import eagle3_ray
    root = eagle3_ray.__path__[0]
    if os.path.isdir(os.path.join(root, "serve")):
        kinds = os.path.isfile(os.path.join(root, "train", "kinds.py"))
        names = ("train.kinds" if kinds else "train.draft", "serve.speculate", "engine.hf")
    else:
        names = ("draft", "speculate", "verifier")
    return tuple(importlib.import_module(f"eagle3_ray.{n}") for n in names)


def _worker(a) -> None:
    import torch
    torch.set_num_threads(a.threads)
    if a.code:                      # import this package's modules from another source tree
        import eagle3_ray
        eagle3_ray.__path__[:] = [os.path.join(a.code, "eagle3_ray")]
    out = measure(tuple(a.tokens), a.context, a.reps, a.draft_vocab)
    print("RESULT " + json.dumps(out), flush=True)


def _run(code: str | None, host: str, a) -> dict:
    env = {**os.environ, **HOSTS[host]}
    cmd = [sys.executable, "-m", "eagle3_ray.bench.verify_cost", "--worker",
           "--threads", str(a.threads), "--context", str(a.context), "--reps", str(a.reps),
           "--draft-vocab", str(a.draft_vocab), "--tokens", *map(str, a.tokens)] + (
               ["--code", code] if code else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode or not line:
        raise RuntimeError(f"worker ({host}, {code or 'working tree'}) failed:\n{p.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT "):])


def summarize(runs: dict, tokens) -> dict:
    """runs[host][version] = [worker results, one per round] -> medians and paired ratios."""
    med = statistics.median
    out = {}
    for host, by_version in runs.items():
        h = out[host] = {}
        for version, results in by_version.items():
            pooled = {kind: {t: med([x for r in results for x in r[f"verify_{kind}_ms"][str(t)]])
                             for t in tokens} for kind in ("wall", "cpu")}
            h[version] = {
                "dtype": results[0]["dtype"], "threads": results[0]["threads"],
                "verify_wall_ms": pooled["wall"], "verify_cpu_ms": pooled["cpu"],
                "verify_wall_over_1": {t: pooled["wall"][t] / pooled["wall"][1] for t in tokens},
                "verify_cpu_over_1": {t: pooled["cpu"][t] / pooled["cpu"][1] for t in tokens},
                "draft_wall_ms": med([x for r in results for x in r["draft_wall_ms"]]),
                "draft_cpu_ms": med([x for r in results for x in r["draft_cpu_ms"]])}
        if {"before", "after"} <= by_version.keys():
            pairs = list(zip(by_version["before"], by_version["after"]))
            h["after_over_before"] = {
                kind: {**{t: med([med(af[f"verify_{kind}_ms"][str(t)])
                                  / med(bf[f"verify_{kind}_ms"][str(t)]) for bf, af in pairs])
                          for t in tokens},
                       "draft": med([med(af[f"draft_{kind}_ms"]) / med(bf[f"draft_{kind}_ms"])
                                     for bf, af in pairs])}
                for kind in ("wall", "cpu")}
    return out


def table(summary: dict, kind: str = "cpu") -> str:
    """A markdown table per host: verify ms (and x of 1 token) before / after, after/before
    (the median of the rounds' paired ratios), and the draft step."""
    lines = []
    for host, s in summary.items():
        before, after = s.get("before"), s["after"]
        ratios = s.get("after_over_before", {}).get(kind, {})

        def cell(v, t):
            if v is None:
                return "-"
            return f"{v[f'verify_{kind}_ms'][t]:.1f} (x{v[f'verify_{kind}_over_1'][t]:.2f})"

        def ratio(key):
            return f"{ratios[key]:.2f}" if key in ratios else "-"

        lines += [f"{host} ({after['dtype']}), {kind} time, ms (x of 1 token)", "",
                  "| tokens | before | after | after/before |", "|---|---|---|---|"]
        lines += [f"| {t} | {cell(before, t)} | {cell(after, t)} | {ratio(t)} |"
                  for t in after[f"verify_{kind}_ms"]]
        draft_before = f"{before[f'draft_{kind}_ms']:.2f}" if before else "-"
        lines += [f"| draft step | {draft_before} | {after[f'draft_{kind}_ms']:.2f} | "
                  f"{ratio('draft')} |", ""]
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    hosts = list(summary)
    fig, axes = plt.subplots(1, len(hosts), figsize=(6.2 * len(hosts), 4.4), squeeze=False)
    for ax, host in zip(axes[0], hosts):
        for version, color in (("before", "tab:red"), ("after", "tab:green")):
            s = summary[host].get(version)
            if not s:
                continue
            ts = sorted(int(t) for t in s["verify_cpu_ms"])
            ax.plot(ts, [s["verify_cpu_ms"][t] for t in ts], "o-", color=color,
                    label=f"{version}: verify, CPU time ({s['dtype']})")
            ax.plot(ts, [s["verify_wall_ms"][t] for t in ts], "x:", color=color, alpha=0.6,
                    label=f"{version}: verify, wall")
            ax.axhline(s["draft_cpu_ms"], color=color, ls="--", lw=1,
                       label=f"{version}: one draft step, CPU {s['draft_cpu_ms']:.1f} ms")
        ax.set_xlabel("tokens in the verifier forward (depth + 1)")
        ax.set_ylabel("ms (1 torch thread)")
        ax.set_title(f"{host}: SmolLM2-135M verify after a 256-token cache")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="git ref of the 'before' code (default: no comparison)")
    p.add_argument("--rounds", type=int, default=4, help="alternating process rounds")
    p.add_argument("--hosts", nargs="+", default=list(HOSTS), choices=list(HOSTS))
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per process")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--code", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return _worker(a)
    a.tokens = sorted(set(a.tokens) | {1})
    runs = {h: {"before": [], "after": []} if a.before else {"after": []} for h in a.hosts}
    with tempfile.TemporaryDirectory() as tmp:
        before = None
        if a.before:
            archive = subprocess.run(["git", "-C", REPO, "archive", a.before, "eagle3_ray"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            before = tmp
        for r in range(a.rounds):
            for host in a.hosts:
                order = ["before", "after"] if a.before else ["after"]
                for version in (order if r % 2 == 0 else order[::-1]):
                    res = _run(before if version == "before" else None, host, a)
                    runs[host][version].append(res)
                    v1 = statistics.median(res["verify_cpu_ms"]["1"])
                    print(f"[verify-cost] round {r + 1}/{a.rounds} {host} {version}: verify "
                          f"1 token {v1:.1f} ms CPU, {max(a.tokens)} tokens "
                          f"{statistics.median(res['verify_cpu_ms'][str(max(a.tokens))]):.1f} ms",
                          flush=True)
    summary = summarize(runs, a.tokens)
    os.makedirs(a.out, exist_ok=True)
    result = {"what": __doc__.split("\n\n")[0], "before": a.before, "rounds": a.rounds,
              "context": a.context, "draft_vocab": a.draft_vocab, "reps_per_round": a.reps,
              "date": time.strftime("%Y-%m-%d %H:%M"), "summary": summary, "raw": runs}
    with open(os.path.join(a.out, "verify-cost.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(summary, os.path.join(a.out, "verify-cost.png"))
    for host, s in summary.items():
        for version in ("before", "after"):
            if version in s:
                v = s[version]
                print(f"[verify-cost] {host} {version} ({v['dtype']}): verify ms (CPU) "
                      + ", ".join(f"{t}: {v['verify_cpu_ms'][t]:.1f}" for t in a.tokens)
                      + f"; draft step {v['draft_cpu_ms']:.2f} ms")
        if "after_over_before" in s:
            print(f"[verify-cost] {host} after/before (CPU): " + ", ".join(
                f"{t}: {x:.2f}" for t, x in s["after_over_before"]["cpu"].items()))
    print(table(summary, "cpu"))
    print(table(summary, "wall"))
    print(f"[verify-cost] -> {a.out}/verify-cost.json, {a.out}/verify-cost.png")


if __name__ == "__main__":
    main()
