"""The planner's per-batch-size depth schedule (plan/load.py), as serve/vllm.py hands it to
vLLM, passes vLLM's own checks: the SpeculativeConfig field's type, the schedule validation and
the dense batch-size -> k lookup its scheduler runs on (vllm/v1/spec_decode/dynamic/utils.py),
in the engine's environment, without starting an engine (one subprocess, ~10-30 s: the vLLM
import)."""
import json
import subprocess

import pytest

from eagle3_ray.engine import vllm as engine_vllm
from eagle3_ray.plan import load, profiles
from eagle3_ray.serve import vllm as serve_vllm

CHECK = r"""
import json, sys
import pydantic
from vllm.config.speculative import SpeculativeConfig
from vllm.v1.spec_decode.dynamic.utils import (build_dynamic_sd_schedule_lookup,
                                               validate_and_normalize_dynamic_sd_schedule)
out = []
for spec, max_num_seqs in json.load(sys.stdin):
    field = SpeculativeConfig.__dataclass_fields__["num_speculative_tokens_per_batch_size"]
    try:
        typed = pydantic.TypeAdapter(field.type).validate_python(
            spec["num_speculative_tokens_per_batch_size"])
        validate_and_normalize_dynamic_sd_schedule(typed)
        dense = build_dynamic_sd_schedule_lookup(typed, max_num_seqs,
                                                 spec["num_speculative_tokens"])
        out.append({"ok": True, "dense": dense})
    except ValueError as e:
        out.append({"ok": False, "error": str(e)})
print("RESULT" + json.dumps(out))
"""


def dense(schedule, max_num_seqs, k):
    """What vLLM's lookup should say: each batch size's k from the ranges (clamped to k)."""
    out = [0] * (max_num_seqs + 1)
    for a, b, d in schedule:
        for n in range(a, min(b, max_num_seqs) + 1):
            out[n] = min(d, k)
    return out


def test_planned_schedules_pass_vllms_own_validation(tmp_path):
    try:
        python = engine_vllm.engine_python()
    except (RuntimeError, FileNotFoundError) as e:
        pytest.skip(str(e))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    cases = []
    for name in ("pcie-8x-rtx-pro-6000-kimi-k2.5", "nvlink-8x-h100-kimi-k2.5"):
        r = load.depth_schedule([0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45],
                                profiles.load_profile(name), 16)
        k, sched = load.vllm_schedule(r)
        cfg = type("C", (), {"depth": k, "depth_schedule": sched})()
        cases.append((serve_vllm.speculative_config(cfg, str(tmp_path)), 256))
    # a schedule with 0 at large batch (the steep case), and one vLLM must refuse
    cases.append(({"num_speculative_tokens": 3,
                   "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 256, 0]]}, 128))
    cases.append(({"num_speculative_tokens": 3,
                   "num_speculative_tokens_per_batch_size": [[2, 4, 3]]}, 128))
    run = subprocess.run([python, "-c", CHECK], input=json.dumps(cases), text=True,
                         capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.split("RESULT", 1)[1])
    for (spec, seqs), res in zip(cases[:-1], got[:-1]):
        assert res["ok"], res
        assert res["dense"] == dense(spec["num_speculative_tokens_per_batch_size"], seqs,
                                     spec["num_speculative_tokens"])
    assert not got[-1]["ok"] and "start at 1" in got[-1]["error"]
