"""The aux layer id rule at every stage (verifier.check_layer_ids): ids >= 1, ascending.

Both engines capture the aux states in one ascending pass over the verifier's layers
(vllm/model_executor/models/llama.py `if idx in self.aux_hidden_state_layers`,
python/sglang/srt/models/llama.py `if i in self.layers_to_capture`), so their fc input is in
ascending layer order whatever the config lists; vLLM captures `hidden_states + residual`, which
does not exist before layer 0. Extraction sorts the ids it is given; training, serving and
export refuse a dataset or drafter made in another order or with id 0. The export side is in
test_checkpoint.py. No Ray: the stage entry points that check the ids run before any."""
import json
import os
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from eagle3_ray.data import schema
from eagle3_ray.engine import hf as verifier
from eagle3_ray.train import checkpoint, kinds
from eagle3_ray.train.draft import DraftConfig, Eagle3Drafter
from eagle3_ray.extract.pipeline import ExtractConfig, dataset_facts
from eagle3_ray.serve.speculate import Speculator


def test_extraction_sorts_the_ids_and_refuses_layer_zero(tiny_verifier, tiny_tokenizer):
    config = AutoConfig.from_pretrained(tiny_verifier)

    def facts(ids):
        return dataset_facts(ExtractConfig(verifier=tiny_verifier, layer_ids=ids), config,
                             tiny_tokenizer)

    # `--layer-ids 5 1 3`: stored (and captured, slot by slot: engine/hf.py forward_hidden with
    # facts["aux_layer_ids"]) in the engines' order
    assert facts([5, 1, 3])["aux_layer_ids"] == [1, 3, 5]
    assert facts(None)["aux_layer_ids"] == [2, 4, 5]                # (2, L//2, L-3), L = 8
    with pytest.raises(ValueError, match=r"--layer-ids \(ExtractConfig.layer_ids\) \[0, 3, 5\]"
                                         r".*>= 1"):
        facts([3, 0, 5])
    with pytest.raises(ValueError, match=r"--layer-ids.*\[1, 3, 8\].*\[1, 8\)"):
        facts([1, 3, 8])


def test_training_refuses_a_dataset_extracted_in_another_order(tiny_verifier, tmp_path):
    from eagle3_ray.train.config import TrainConfig
    from eagle3_ray.train.trainer import prepare
    tok = verifier.load_tokenizer(tiny_verifier)
    config = AutoConfig.from_pretrained(tiny_verifier)
    facts = verifier.verifier_facts(tiny_verifier, config, tok, [1, 3, 5])
    for ids, why in (([5, 1, 3], r"ascending \(\[1, 3, 5\]\)"), ([0, 3, 5], ">= 1")):
        ds = tmp_path / f"ds{ids[0]}"
        ds.mkdir()
        (ds / schema.MANIFEST).write_text(json.dumps(   # what an older extraction wrote
            {"format": schema.FORMAT, "format_version": schema.FORMAT_VERSION,
             "facts": dict(facts, aux_layer_ids=ids), "files": []}))
        cfg = TrainConfig(dataset=str(ds), output=str(tmp_path / "run"), verifier=tiny_verifier)
        with pytest.raises(ValueError, match=re.escape(f"aux_layer_ids {ids}") + ".*" + why):
            prepare(cfg)
        assert not os.path.exists(tmp_path / "run" / "vocab.json")


def _old_drafter(tiny_verifier, directory, ids) -> str:
    """A drafter checkpoint as saved before the rule (config.json rewritten to the same size)."""
    drafter, _ = kinds.untrained_drafter(tiny_verifier, draft_vocab_size=2000)   # ids [2, 4, 5]
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens")}
    d = checkpoint.save_drafter(directory, state, drafter.config, {"ttt_steps": 2})
    path = os.path.join(d, checkpoint.CONFIG)
    config = json.load(open(path))
    config["eagle3_ray"]["draft_config"]["aux_layer_ids"] = ids
    size = os.path.getsize(path)
    checkpoint._write_json(path, config)
    assert os.path.getsize(path) == size
    return d


def test_serving_refuses_a_drafter_in_another_order(tiny_verifier, tmp_path):
    vcfg = AutoConfig.from_pretrained(tiny_verifier)
    ok = _old_drafter(tiny_verifier, str(tmp_path / "ok"), [2, 4, 5])
    checkpoint.check_drafter(ok, vcfg, tiny_verifier)
    for ids, why in (([5, 2, 4], "ascending"), ([0, 4, 5], ">= 1")):
        d = _old_drafter(tiny_verifier, str(tmp_path / f"d{ids[0]}"), ids)
        with pytest.raises(ValueError, match=r"does not match.*aux_layer_ids.*" + why):
            checkpoint.check_drafter(d, vcfg, tiny_verifier)

    model = AutoModelForCausalLM.from_pretrained(tiny_verifier, dtype=torch.float32)
    c = DraftConfig.from_verifier_config(vcfg, 2000, [5, 2, 4])
    with pytest.raises(ValueError, match="aux_layer_ids.*ascending"):
        Speculator(model, Eagle3Drafter(c))
    with pytest.raises(ValueError, match="layer_ids.*>= 1"):
        Speculator(model, Eagle3Drafter(c), layer_ids=[0, 2, 4])
    assert Speculator(model, Eagle3Drafter(c), layer_ids=[2, 4, 5]).layer_ids == [2, 4, 5]
