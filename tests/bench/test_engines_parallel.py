"""A parallel (P-EAGLE) drafter served for real by vLLM's CPU build (.venv-vllm) and by the
builtin decoder, through `bench engines` end to end (Ray actors in the engine environment):
vLLM drafts in parallel from our export (mask_hidden, mask_token_id) exactly as the builtin
decoder does, and neither changes the greedy output."""
import numpy as np
import pytest
import torch

from eagle3_ray.bench import engines
from eagle3_ray.data import conversations as data
from eagle3_ray.engine import hf as verifier, vllm as engine_vllm
from eagle3_ray.train import checkpoint, draft, ttt, vocab

DEPTH = 3


def train_parallel_drafter(spec: str, out: str, prompts: list[list[int]], steps: int = 60) -> str:
    """A parallel drafter trained in-process on the verifier's own greedy continuations of
    `prompts` (so its drafts past the first get accepted too), saved as a real checkpoint."""
    model = verifier.load_verifier(spec, dtype=torch.float32)
    with torch.no_grad():
        seqs = [model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
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
    c = draft.DraftConfig.from_verifier_config(model.config, 256, layer_ids, drafting="parallel")
    drafter, teacher = draft.build_drafter(spec, c, *vocab.build_mapping(counts, 256),
                                           teacher_check=False)
    batch = {"input_ids": ids, "attention_mask": att, "loss_mask": att,
             "aux_hidden_states": aux.flatten(2).clone(), "last_hidden_states": last.clone(),
             "target_ids": greedy.clone()}
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss, _ = ttt.ttt_loss(drafter, teacher, batch, DEPTH, targets="hard")
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {k: v.detach() for k, v in drafter.state_dict().items()
             if not k.startswith("embed_tokens")}
    return checkpoint.save_drafter(out, state, drafter.config,
                                   {"ttt_steps": DEPTH, "verifier": spec, "steps": steps})


def test_vllm_drafts_a_parallel_drafter_as_the_builtin_decoder_does(ray_cluster, vllm_verifier,
                                                                    tmp_path):
    try:
        engine_vllm.engine_python()
    except RuntimeError as e:
        pytest.skip(str(e))
    prompts = data.heldout_prompts(verifier.load_tokenizer(vllm_verifier), 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        d = train_parallel_drafter(vllm_verifier, str(tmp_path / "drafter"), prompts)
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
