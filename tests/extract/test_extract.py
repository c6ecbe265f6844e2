"""Extraction through real Ray Data on a tiny random Llama: exact hidden states, the contract,
faults and resume."""
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pyarrow.parquet as pq
import pytest
import torch

from conftest import CONVERSATIONS, USABLE_TEXTS, make_conversations
from eagle3_ray.data import conversations as data, schema
from eagle3_ray.extract.pipeline import ExtractConfig, run_extract

N_GENERATED = 40


@pytest.fixture(scope="module")
def conv_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("convs") / "convs.json"
    p.write_text(json.dumps(CONVERSATIONS + make_conversations(N_GENERATED)))
    return str(p)


def expected_ids(path):
    return {sid for sid, _ in data.iter_samples([path])}


def config(verifier, inputs, output, **kw):
    kw = {"max_length": 128, "batch_rows": 8, "token_budget": 300, **kw}
    return ExtractConfig(verifier=verifier, inputs=[inputs], output=str(output), **kw)


def read_rows(output):
    fs, root = schema.resolve_fs(str(output))
    rows = []
    for p in schema.list_parts(fs, root):
        rows += pq.read_table(p).to_pylist()  # plain pyarrow, no eagle3_ray reader
    return rows


def test_hidden_states_equal_plain_forward(ray_cluster, tiny_verifier, tiny_tokenizer, conv_file,
                                          tmp_path):
    from transformers import AutoModelForCausalLM
    out = tmp_path / "ds"
    # fp32, to compare against a plain fp32 forward (the default is bf16 on bf16-native CPUs)
    manifest = run_extract(config(tiny_verifier, conv_file, out, dtype="float32"))
    rows = read_rows(out)
    assert {r["sample_id"] for r in rows} == expected_ids(conv_file)
    assert len(rows) == 3 + N_GENERATED == manifest["summary"]["samples"]

    model = AutoModelForCausalLM.from_pretrained(tiny_verifier, dtype=torch.float32).eval()
    h, layer_ids = model.config.hidden_size, manifest["facts"]["aux_layer_ids"]
    assert layer_ids == [2, 4, 5]  # (2, L//2, L-3) for L=8
    last_out = {}
    model.model.layers[-1].register_forward_hook(lambda m, i, o: last_out.update(h=o))
    for row in rows:
        t = schema.decode_row(row, h)
        assert len(row["aux_hidden_states"]) == len(row["input_ids"]) * 3 * h * 2   # bf16 [S,3,H]
        with torch.no_grad():
            ref = model(t["input_ids"][None], output_hidden_states=True)
        for slot, layer in enumerate(layer_ids):
            torch.testing.assert_close(t["aux_hidden_states"][:, slot],
                                       ref.hidden_states[layer][0].to(torch.bfloat16))
        torch.testing.assert_close(t["last_hidden_states"], last_out["h"][0].to(torch.bfloat16))
        # the teacher: lm_head(norm(last)) reproduces the verifier's logits
        teacher = model.lm_head(model.model.norm(t["last_hidden_states"].float()))
        assert (teacher.argmax(-1) == ref.logits[0].argmax(-1)).float().mean() > 0.97
        # target_ids: the verifier's own greedy next tokens, computed at extraction
        assert (t["target_ids"] == ref.logits[0].argmax(-1)).float().mean() > 0.99

    # the loss mask decodes back to exactly the assistant texts
    for row in rows:
        stem, index, _ = row["sample_id"].split(":")
        if int(index) in USABLE_TEXTS:
            ids, mask = row["input_ids"], row["loss_mask"]
            runs, cur = [], []
            for tok_id, m in zip(ids + [0], mask + [0]):
                if m:
                    cur.append(tok_id)
                elif cur:
                    runs.append(tiny_tokenizer.decode(cur))
                    cur = []
            assert runs == USABLE_TEXTS[int(index)]

    # schema and manifest round-trip
    fs, root = schema.resolve_fs(str(out))
    for p in schema.list_parts(fs, root):
        assert pq.read_schema(p).remove_metadata().equals(schema.SCHEMA)
        assert schema.part_facts(fs, p) == manifest["facts"]
    assert schema.read_manifest(str(out)) == manifest
    s = manifest["summary"]
    assert s["tokens"] == sum(r["num_tokens"] for r in rows)
    assert s["loss_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert s["skipped"] == {"no_assistant_turn": 1, "empty": 1, "unknown_role": 1}
    assert s["hidden_bytes_per_token"] == 8 * h
    assert s["target_ids"] is True and schema.stores_target_ids(manifest)
    # a format-1 part (no target_ids) is told apart, so a trainer keeps the full-vocab check
    old = tmp_path / "format1.parquet"
    pq.write_table(pq.read_table(schema.list_parts(fs, root)[0]).drop_columns(["target_ids"]), old)
    assert schema.part_stats(fs, str(old))["target_ids"] is False
    assert sorted(os.listdir(out)) == ["manifest.json"] + [f["name"] for f in manifest["files"]]

    # a rerun finds everything done and changes nothing
    again = run_extract(config(tiny_verifier, conv_file, out))
    assert again["summary"]["this_run"]["samples"] == 0
    assert again["files"] == manifest["files"]

    # a different extraction config into the same directory is refused, naming file and field
    with pytest.raises(schema.DatasetMismatch, match=r"part-.*aux_layer_ids"):
        run_extract(config(tiny_verifier, conv_file, out, layer_ids=[1, 2, 3]))
    # ... and so is a training-side check against another verifier's facts
    with pytest.raises(schema.DatasetMismatch, match="hidden_size"):
        schema.check_compatible(manifest, {**manifest["facts"], "hidden_size": 4096}, str(out))


def test_actor_killed_mid_batch_is_restarted_and_nothing_duplicated(ray_cluster, tiny_verifier,
                                                                    conv_file, tmp_path):
    marker = tmp_path / "died"
    out = tmp_path / "ds"
    # part_bytes=1: every micro-batch is flushed to its own part, so the actor dies after some
    # of its batch is already on disk; the retried batch must rewrite exactly those files.
    m = run_extract(config(tiny_verifier, f"file://{conv_file}", f"file://{out}", part_bytes=1,
                           fault_injection=f"die_once:{marker}"))
    assert marker.exists()  # the actor really died once (os._exit mid-batch)
    ids = [r["sample_id"] for r in read_rows(out)]
    assert len(ids) == len(set(ids)) and set(ids) == expected_ids(conv_file)
    assert m["summary"]["samples"] == len(ids)


def test_killed_run_resumes_without_loss_or_duplicates(ray_cluster, tiny_verifier, conv_file,
                                                       tmp_path):
    """SIGKILL the whole `eagle3-ray extract` process group after its first part, rerun."""
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "eagle3_ray.cli", "extract", "--verifier", tiny_verifier,
           "--inputs", conv_file, "--output", str(out), "--max-length", "128",
           "--batch-rows", "2", "--token-budget", "300"]
    env = {**os.environ, "EAGLE3_RAY_FAULT": "sleep:0.4"}
    log = tmp_path / "extract.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=f, stderr=f)
    fs, root = schema.resolve_fs(str(out))
    deadline = time.time() + 180
    while len(schema.list_parts(fs, root)) < 3 and time.time() < deadline:
        assert proc.poll() is None, f"extract exited before it could be killed:\n" \
            f"{log.read_text()[-3000:]}"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(2)
    before = {r["sample_id"] for r in read_rows(out)}
    assert 0 < len(before) < len(expected_ids(conv_file))
    assert not (out / "manifest.json").exists()

    m = run_extract(config(tiny_verifier, conv_file, out, batch_rows=2))
    ids = [r["sample_id"] for r in read_rows(out)]
    assert len(ids) == len(set(ids)) and set(ids) == expected_ids(conv_file)
    assert m["summary"]["this_run"]["resumed_samples"] == len(before)
    assert m["summary"]["this_run"]["samples"] == len(ids) - len(before)


def test_regenerate_writes_the_verifiers_own_answers(ray_cluster, tiny_verifier, tiny_tokenizer,
                                                     tmp_path):
    from transformers import AutoModelForCausalLM
    convs = tmp_path / "c.json"
    convs.write_text(json.dumps([CONVERSATIONS[1], CONVERSATIONS[4]]))
    out = tmp_path / "ds"
    m = run_extract(config(tiny_verifier, str(convs), out, regenerate=True,
                           regen_max_new_tokens=6))
    assert m["facts"]["regenerate"]["max_new_tokens"] == 6
    rows = read_rows(out)
    assert len(rows) == 2
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier, dtype=torch.float32).eval()
    for row, conv in zip(sorted(rows, key=lambda r: int(r["sample_id"].split(":")[1])),
                         [CONVERSATIONS[1], CONVERSATIONS[4]]):
        msgs = data.normalize(conv)
        prompt = tiny_tokenizer.apply_chat_template(msgs[:-1], add_generation_prompt=True,
                                                    tokenize=False)
        ids = torch.tensor([tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        gen = model.generate(ids, max_new_tokens=6, do_sample=False,
                             pad_token_id=tiny_tokenizer.pad_token_id)
        expected = tiny_tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
        answer = [t for t, k in zip(row["input_ids"], row["loss_mask"]) if k]
        assert tiny_tokenizer.decode(answer) == expected != msgs[-1]["content"]


def test_bad_input_paths_are_clear_errors(ray_cluster, tiny_verifier, conv_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        run_extract(config(tiny_verifier, str(tmp_path / "missing.jsonl"), tmp_path / "o"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        run_extract(config(str(tmp_path), conv_file, tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_extractor_tokenizes_raw_batches_as_the_tokenize_stage_does(tiny_verifier, conv_file,
                                                                   tmp_path):
    """CPU replicas get raw (sample_id, messages_json) batches and tokenize them themselves; GPU
    replicas get them from the Tokenize actors: the same rows either way, bit for bit."""
    import pyarrow as pa
    from eagle3_ray.engine import hf as verifier
    from eagle3_ray.extract import pipeline as extract
    cpu = config(tiny_verifier, conv_file, tmp_path / "o", dtype="float32")
    assert extract.tokenizes_in_extractor(cpu)
    assert not extract.tokenizes_in_extractor(replace(cpu, gpus_per_replica=1))
    assert extract.tokenizes_in_extractor(replace(cpu, gpus_per_replica=1, tokenizer_actors=0))
    assert extract.micro_batch_tokens(cpu) == 300        # the config's budget when set
    assert extract.micro_batch_tokens(replace(cpu, token_budget=0)) == 2048
    assert extract.micro_batch_tokens(replace(cpu, token_budget=0, gpus_per_replica=1)) == 16384

    tok = verifier.load_tokenizer(tiny_verifier)
    samples = list(data.iter_samples([conv_file]))[:8]
    raw = pa.table({"sample_id": [s for s, _ in samples],
                    "messages_json": [json.dumps(m) for _, m in samples]})
    facts = extract.dataset_facts(cpu, verifier.load_config(tiny_verifier), tok)
    actor = extract.VerifierExtractor(cpu, facts)
    inline, skipped_inline, _, _ = actor._extract(raw)
    staged, skipped_staged, _, _ = actor._extract(extract.Tokenize(tiny_verifier, 128)(raw))
    assert skipped_inline == skipped_staged
    assert pa.concat_tables(inline).equals(pa.concat_tables(staged))


def test_part_values_fill_the_part_schema():
    """One sample's column values, cut from padded hidden states; the batch counts."""
    import pyarrow as pa
    from eagle3_ray.extract import pipeline as extract
    row = {"sample_id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    aux, last, greedy = torch.randn(5, 3, 8), torch.randn(5, 8), torch.arange(5)  # padded to 5
    for storage in schema.HIDDEN_STORAGES:
        v = extract.part_values(row, aux, last, greedy, storage)
        assert set(v) == set(schema.schema_for(storage).names)
        assert v["num_tokens"] == 3 and v["target_ids"] == [0, 1, 2]
        assert v["aux_hidden_states"] == schema.encode_hidden(aux[:3], storage)[0]
    t = pa.table({k: [x] for k, x in v.items()}, schema=schema.schema_for(storage))
    assert extract.batch_counts([t, t]) == {"samples": 2, "tokens": 6, "loss_tokens": 4}


def test_offline_cpu_replicas_run_at_niceness_zero(ray_cluster, tiny_verifier):
    """Ray starts workers at niceness 15; an offline CPU replica's runtime_env asks for 0 (a real
    Ray actor reports its niceness). GPU and online replicas keep Ray's default."""
    from eagle3_ray.extract.pipeline import replica_runtime_env

    @ray_cluster.remote(num_cpus=0)
    class Probe:
        def nice(self):
            return os.nice(0)

    def niceness(cfg):
        actor = Probe.options(runtime_env=replica_runtime_env(cfg)).remote()
        return ray_cluster.get(actor.nice.remote())

    cpu = ExtractConfig(verifier=tiny_verifier)
    assert niceness(cpu) == 0
    assert niceness(replace(cpu, emit="rows")) == 15
    assert replica_runtime_env(replace(cpu, gpus_per_replica=1)) is None
