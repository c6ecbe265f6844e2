"""profile --engine vllm (serve/profile_vllm.py): vLLM's own decode rounds over batch size x
depth, for the planner's depth-by-load schedule.

For real, once: one engine in vLLM's environment (the tiny vLLM-sized random verifier of
conftest, an untrained drafter of its shape, depth 2, fp32, 1 thread, as `serve --engine vllm`
starts it), batches 1 and 2, stepped by hand: every timed step decoded every sequence, the
rounds are positive and the drafter's tokens per step are 1 + accepted. ~30 s, most of it
vLLM's start. The arms' engine arguments and the refusals run without vLLM."""
import json

import pytest
from conftest import missing_engine_env

from eagle3_ray.serve import profile_vllm
from eagle3_ray.serve import vllm as serve_vllm
from eagle3_ray.serve.app import ServeConfig
from eagle3_ray.train import checkpoint, kinds


def drafter_for(verifier: str, out: str) -> str:
    drafter, _ = kinds.untrained_drafter(verifier, 64)
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens")}
    return checkpoint.save_drafter(out, state, drafter.config, {"ttt_steps": 2,
                                                                "verifier": verifier})


def config(verifier: str, drafter: str) -> ServeConfig:
    return ServeConfig(verifier=verifier, drafter=drafter, engine="vllm", dtype="fp32",
                       eager=True, cpus_per_replica=1, max_model_len=256, api_key=None)


def test_arms_are_the_served_engine_with_their_depth(vllm_verifier, tmp_path):
    cfg = config(vllm_verifier, drafter_for(vllm_verifier, str(tmp_path / "d")))
    export = serve_vllm.ensure_vllm_export(cfg)                  # the drafter in vLLM's layout
    plain = profile_vllm.arm_kwargs(cfg, export, None, 16)
    assert "speculative_config" not in plain and plain["max_num_seqs"] == 16
    assert plain["dtype"] == "float32" and plain["enforce_eager"] and plain["max_model_len"] == 256
    k0 = profile_vllm.arm_kwargs(cfg, export, 0, 16)["speculative_config"]
    assert k0["num_speculative_tokens"] == 1 and k0["model"] == export
    assert k0["num_speculative_tokens_per_batch_size"] == [[1, 256, 0]]    # upkeep only
    k3 = profile_vllm.arm_kwargs(cfg, export, 3, 16, synthetic=0.5)["speculative_config"]
    assert k3["num_speculative_tokens"] == 3 and "num_speculative_tokens_per_batch_size" not in k3
    assert k3["rejection_sample_method"] == "synthetic"
    assert k3["synthetic_acceptance_rates"] == [0.5, 0.25, 0.125]         # unconditional
    with pytest.raises(ValueError, match="CPU sampler refuses synthetic"):
        profile_vllm.measure_rounds(cfg, synthetic=0.5)
    with pytest.raises(ValueError, match="needs --drafter"):
        profile_vllm.measure_rounds(config(vllm_verifier, None))


def test_a_drafter_arm_measured_in_vllm(vllm_verifier, tmp_path):
    why = missing_engine_env()
    if why:
        pytest.skip(why)
    cfg = config(vllm_verifier, drafter_for(vllm_verifier, str(tmp_path / "d")))
    got = profile_vllm.measure_rounds(cfg, depths=[2], batches=[1, 2], tokens=8, reps=1,
                                      plain=False)
    assert got["engine"].startswith("vllm ") and got["plain_batch_ms"] == {}
    assert set(got["round_batch_ms"]) == {2} and set(got["round_batch_ms"][2]) == {1, 2}
    assert all(ms > 0 for ms in got["round_batch_ms"][2].values())
    arm = got["arms"]["k2"]
    assert arm["speculative_config"]["num_speculative_tokens"] == 2
    for b, c in arm["checks"].items():
        # 8 tokens: prefill's 1, then up to 7 decode steps, each timed from the step before
        # but the last (it finishes the requests); each step emits 1 + accepted (of 2 drafts)
        # tokens per sequence
        assert 1 <= c["steps"] <= 6 and c["p10_ms"] <= c["p90_ms"], (b, c)
        assert 1.0 <= c["tokens_per_step"] <= 3.0
    json.dumps(got)                                          # what profile writes beside it
