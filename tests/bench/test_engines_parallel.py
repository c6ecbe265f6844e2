"""A parallel (P-EAGLE) drafter served for real by vLLM's CPU build (.venv-vllm) and by the
builtin decoder, through `bench engines` end to end (Ray actors in the engine environment):
vLLM drafts in parallel from our export (mask_hidden, mask_token_id) exactly as the builtin
decoder does, and neither changes the greedy output."""
import pytest
import torch

from eagle3_ray.bench import engines
from eagle3_ray.data import conversations as data
from eagle3_ray.engine import hf as verifier, vllm as engine_vllm

DEPTH = 3


def test_vllm_drafts_a_parallel_drafter_as_the_builtin_decoder_does(ray_cluster, vllm_verifier,
                                                                    tmp_path, train_tiny_drafter):
    try:
        engine_vllm.engine_python()
    except RuntimeError as e:
        pytest.skip(str(e))
    prompts = data.heldout_prompts(verifier.load_tokenizer(vllm_verifier), 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        d = train_tiny_drafter(vllm_verifier, str(tmp_path / "drafter"), prompts, steps=60,
                               depth=DEPTH, drafting="parallel", new_tokens=24)
    finally:
        torch.set_num_threads(threads)
    r = engines.bench_engines(d, prompts=2, max_tokens=16, depths=(DEPTH,), dtype="fp32",
                              spec=vllm_verifier, threads=1, out_dir=str(tmp_path / "bench"))
    assert r["vllm"][str(DEPTH)]["speculative_config"]["parallel_drafting"] is True
    assert r["compare"][str(DEPTH)]["identical_prompts"] == 2        # both engines, token for token
    for e in engines.ENGINES:
        assert r["runs"][e][str(DEPTH)]["identical_to_depth0"] == 2, e
    b = r["runs"]["builtin"][str(DEPTH)]["positions"]
    v = r["runs"]["vllm"][str(DEPTH)]["positions"]
    assert [p["accepted"] for p in b] == [p["accepted"] for p in v]  # fp32: the same drafts
    assert [p["drafted"] for p in b] == [p["drafted"] for p in v]
    assert b[1]["accepted"] > 0          # a mask slot's draft accepted: parallel drafting works
