"""End to end on the embedded default: SmolLM2-135M-Instruct (GGUF from PyPI) and ShareGPT V3."""
import json

import pyarrow.parquet as pq
import pytest
import torch

from eagle3_ray import schema, verifier
from eagle3_ray.extract import ExtractConfig, run_extract


@pytest.mark.slow
def test_extract_embedded_default_through_ray(ray_cluster, tmp_path):
    out = tmp_path / "hs"
    m = run_extract(ExtractConfig(output=str(out), sample_limit=4, max_length=192, batch_rows=2))
    f, s = m["facts"], m["summary"]
    assert (f["hidden_size"], f["num_layers"], f["vocab_size"]) == (576, 30, 49152)
    assert f["aux_layer_ids"] == [2, 15, 27]
    assert s["samples"] + sum(v for k, v in s["skipped"].items() if k != "empty_message") == 4
    assert s["samples"] >= 2 and s["loss_tokens"] > 0
    assert s["bytes_per_token"] <= s["hidden_bytes_per_token"] == 8 * 576

    # the stored teacher state reproduces SmolLM2's own next-token predictions
    model = verifier.load_verifier(verifier.EMBEDDED_VERIFIER)
    fs, root = schema.resolve_fs(str(out))
    row = pq.read_table(schema.list_parts(fs, root)[0]).to_pylist()[0]
    t = schema.decode_row(row, 576)
    with torch.no_grad():
        ref = model(t["input_ids"][None]).logits[0].argmax(-1)
        teacher = model.lm_head(model.model.norm(t["last_hidden_states"].float())).argmax(-1)
    assert (teacher == ref).float().mean() > 0.95
    assert json.loads((out / "manifest.json").read_text())["facts"] == f
