"""fp8 (e4m3, a float32 scale per token and slot) hidden-state storage: the codec's error bounds,
real extractions through Ray Data into both storages read back, old datasets still read,
storages never mixed in one directory, training on an fp8 dataset."""
import json

import pyarrow.parquet as pq
import pytest
import torch

from conftest import make_conversations
from eagle3_ray.data import schema
from eagle3_ray.extract.pipeline import ExtractConfig, run_extract

H = 64  # the tiny verifier's hidden size


def test_encode_decode_error_bounds_and_zeros():
    g = torch.Generator().manual_seed(0)
    # rows over 12 orders of magnitude, so every row needs its own scale
    x = torch.randn(40, 3, 96, generator=g) * torch.logspace(-6, 6, 40)[:, None, None]
    x[5] = 0                    # an all-zero token (every slot)
    x[6, 1] = 0                 # one all-zero slot
    x[7, 2, :17] = 0            # exact zeros inside a row
    x = x.to(torch.bfloat16)    # what extraction hands over
    blob, scales = schema.encode_hidden(x, "fp8_e4m3")
    assert len(blob) == x.numel() and len(scales) == 4 * 40 * 3          # 1 B/elem, f32 [S, 3]
    y = schema.decode_row({"num_tokens": 40, "input_ids": [0] * 40, "loss_mask": [1] * 40,
                           "aux_hidden_states": blob, "aux_hidden_scales": scales,
                           "last_hidden_states": schema.encode_hidden(x[:, 0], "fp8_e4m3")[0],
                           "last_hidden_scales": schema.encode_hidden(x[:, 0], "fp8_e4m3")[1]},
                          96)
    aux, last = y["aux_hidden_states"], y["last_hidden_states"]
    assert aux.dtype == last.dtype == torch.bfloat16 and aux.shape == (40, 3, 96)
    xf, yf = x.float(), aux.float()
    scale = xf.abs().amax(-1, keepdim=True) / 448                          # [S, 3, 1]
    err = (yf - xf).abs()
    # e4m3 normals: 3 mantissa bits -> relative error <= 2^-4 (+ the bf16 rounding of the
    # result); its subnormals (below 2^-6 in scaled units): absolute error <= scale * 2^-10
    assert bool((err <= xf.abs() * (2 ** -4 + 2 ** -8) + scale * 2 ** -10).all())
    normal = xf.abs() >= scale * 2 ** -6
    assert float((err / xf.abs().clamp_min(1e-38))[normal].max()) <= 2 ** -4 + 2 ** -8
    # and on average far better: the relative L2 error of a token's vector is ~2-3%
    rel = (yf - xf).norm(dim=-1) / xf.norm(dim=-1).clamp_min(1e-38)
    assert float(rel[xf.norm(dim=-1) > 0].mean()) < 0.04
    # zeros stay exactly zero; the largest element of a row is exact up to bf16 rounding
    assert bool((aux[5] == 0).all() and (aux[6, 1] == 0).all() and (aux[7, 2, :17] == 0).all())
    torch.testing.assert_close(last, aux[:, 0])
    # bf16 storage: no scales, bit-exact
    b, s = schema.encode_hidden(x, "bf16")
    assert s is None and schema.decode_bf16(b, tuple(x.shape)).equal(x)
    with pytest.raises(ValueError, match="inf/nan"):
        schema.encode_hidden(torch.tensor([[1.0, float("inf")]]), "fp8_e4m3")
    with pytest.raises(ValueError, match="hidden storage"):
        schema.encode_hidden(x, "fp4")
    with pytest.raises(ValueError, match="expected shape"):
        schema.decode_fp8(blob, scales[:-4], (40, 3, 96))


@pytest.fixture(scope="module")
def datasets(ray_cluster, tiny_verifier, tmp_path_factory):
    """The same conversations extracted into bf16 and into fp8 (fp32 verifier)."""
    d = tmp_path_factory.mktemp("fp8")
    (d / "convs.json").write_text(json.dumps(make_conversations(24)))
    out = {}
    for storage in ("bf16", "fp8_e4m3"):
        out[storage] = (str(d / storage), run_extract(ExtractConfig(
            verifier=tiny_verifier, inputs=[str(d / "convs.json")], output=str(d / storage),
            max_length=96, batch_rows=24, dtype="float32", hidden_storage=storage)))
    out["convs"] = str(d / "convs.json")
    return out


def rows_by_id(path):
    fs, root = schema.resolve_fs(path)
    return {r["sample_id"]: r for p in schema.list_parts(fs, root)
            for r in pq.read_table(p).to_pylist()}       # plain pyarrow


def test_fp8_extraction_reads_back_close_to_bf16(datasets):
    (bf_dir, bf), (f8_dir, f8) = datasets["bf16"], datasets["fp8_e4m3"]
    assert bf["format_version"] == 2 and f8["format_version"] == 3
    assert schema.hidden_storage(bf) == "bf16" and schema.hidden_storage(f8) == "fp8_e4m3"
    assert schema.read_manifest(f8_dir) == f8
    fs, root = schema.resolve_fs(f8_dir)
    for p in schema.list_parts(fs, root):
        assert pq.read_schema(p).remove_metadata().equals(schema.SCHEMA_FP8)
        assert schema.part_facts(fs, p)["hidden_storage"] == "fp8_e4m3"
    fs, root = schema.resolve_fs(bf_dir)
    for p in schema.list_parts(fs, root):
        assert pq.read_schema(p).remove_metadata().equals(schema.SCHEMA)

    a, b = rows_by_id(bf_dir), rows_by_id(f8_dir)
    assert a.keys() == b.keys() and len(a) == 24
    for sid, rb in a.items():
        rf = b[sid]
        s = rf["num_tokens"]
        assert rf["input_ids"] == rb["input_ids"] and rf["target_ids"] == rb["target_ids"]
        assert len(rf["aux_hidden_states"]) == s * 3 * H and len(rf["aux_hidden_scales"]) == s * 12
        assert len(rf["last_hidden_states"]) == s * H and len(rf["last_hidden_scales"]) == s * 4
        tb, tf = schema.decode_row(rb, H), schema.decode_row(rf, H)
        for k in ("aux_hidden_states", "last_hidden_states"):
            x, y = tb[k].float(), tf[k].float()
            assert tf[k].dtype == torch.bfloat16 and y.shape == x.shape
            scale = x.abs().amax(-1, keepdim=True) / 448
            assert bool(((y - x).abs() <= x.abs() * (2 ** -4 + 2 ** -8) + scale * 2 ** -10).all())

    sb, sf = bf["summary"], f8["summary"]
    assert sb["tokens"] == sf["tokens"] and sb["samples"] == sf["samples"] == 24
    assert sb["hidden_bytes_per_token"] == sb["bf16_hidden_bytes_per_token"] == 8 * H
    assert sf["hidden_bytes_per_token"] == 4 * H + 16 and sf["bf16_hidden_bytes_per_token"] == 8 * H
    assert sf["hidden_storage"] == "fp8_e4m3" and sb["hidden_storage"] == "bf16"
    # on disk: the fp8 states take well under the bf16 ones (zstd on top of both)
    assert 0 < sf["hidden_disk_bytes_per_token"] < 0.6 * sb["hidden_disk_bytes_per_token"]
    assert sf["hidden_disk_bytes_per_token"] <= sf["bytes_per_token"]


def test_storages_never_mix_in_one_directory(datasets, tiny_verifier):
    bf_dir, _ = datasets["bf16"]
    with pytest.raises(schema.DatasetMismatch, match=r"part-.*\.parquet.*hidden_storage: dataset "
                                                     r"has 'bf16', expected 'fp8_e4m3'"):
        run_extract(ExtractConfig(verifier=tiny_verifier, inputs=[datasets["convs"]],
                                  output=bf_dir, max_length=96, batch_rows=16, dtype="float32",
                                  hidden_storage="fp8_e4m3"))
    with pytest.raises(ValueError, match="columns .* do not fit the bf16 schema"):
        fs, root = schema.resolve_fs(bf_dir)
        t = pq.read_table(schema.list_parts(fs, root)[0])
        schema.write_part(fs, root, t.append_column("aux_hidden_scales", t["sample_id"]), {})
    with pytest.raises(ValueError, match="hidden storage must be one of"):
        run_extract(ExtractConfig(verifier=tiny_verifier, inputs=[datasets["convs"]],
                                  output=bf_dir, hidden_storage="fp16"))


def test_a_format_2_dataset_without_the_storage_fact_still_reads(datasets, tiny_verifier,
                                                                 tmp_path):
    """A dataset written before the storage fact existed: no hidden_storage in the parts'
    metadata or the manifest, format_version 2. It reads, trains-side checks pass, a bf16 rerun
    resumes it, and fp8 into it is refused."""
    src, _ = datasets["bf16"]
    fs, root = schema.resolve_fs(src)
    old = tmp_path / "old"
    old.mkdir()
    for p in schema.list_parts(fs, root):
        t = pq.read_table(p)
        facts = json.loads(t.schema.metadata[schema.METADATA_KEY])
        del facts["hidden_storage"]
        pq.write_table(t.replace_schema_metadata({schema.METADATA_KEY: json.dumps(facts)}),
                       str(old / p.rsplit("/", 1)[1]), compression="zstd")
    m = json.load(open(f"{src}/manifest.json"))
    del m["facts"]["hidden_storage"]
    m["format_version"] = 2
    (old / "manifest.json").write_text(json.dumps(m))

    got = schema.read_manifest(str(old))
    assert schema.hidden_storage(got) == "bf16"
    a, b = rows_by_id(src), rows_by_id(str(old))
    for sid in a:
        ta, tb = schema.decode_row(a[sid], H), schema.decode_row(b[sid], H)
        assert all(ta[k].equal(tb[k]) for k in ta)
    again = run_extract(ExtractConfig(verifier=tiny_verifier, inputs=[datasets["convs"]],
                                      output=str(old), max_length=96, batch_rows=16,
                                      dtype="float32"))
    assert again["summary"]["this_run"]["samples"] == 0 and again["summary"]["samples"] == 24
    with pytest.raises(schema.DatasetMismatch, match="hidden_storage"):
        run_extract(ExtractConfig(verifier=tiny_verifier, inputs=[datasets["convs"]],
                                  output=str(old), max_length=96, batch_rows=16,
                                  dtype="float32", hidden_storage="fp8_e4m3"))
    # a version newer than this code is refused at the manifest
    m["format_version"] = schema.FORMAT_VERSION + 1
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(schema.DatasetMismatch, match="newer"):
        schema.read_manifest(str(old))


def test_training_runs_on_an_fp8_dataset(datasets, tiny_verifier, tmp_path):
    from eagle3_ray.train.config import TrainConfig
    from eagle3_ray.train.trainer import evaluate_drafter, run_train
    f8_dir, _ = datasets["fp8_e4m3"]
    out = tmp_path / "run"
    run_train(TrainConfig(dataset=f8_dir, output=str(out), verifier=tiny_verifier, ttt_steps=2,
                          draft_vocab_size=49152, batch_size=4, max_steps=4, lr=3e-3,
                          warmup_steps=2, log_every=2, eval_every=0, checkpoint_every=4,
                          eval_fraction=0.25, num_workers=1, cpus_per_worker=1))
    hist = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert hist[-1]["step"] == 4 and "eval/acc_0" in hist[-1]
    assert all(h["train/loss"] == h["train/loss"] for h in hist)   # finite, no NaN
    # the offline evaluator reads fp8 too, and the same drafter scores alike on bf16 states
    ev8 = evaluate_drafter(str(out / "drafter"), f8_dir, 2, eval_fraction=0.25)
    ev16 = evaluate_drafter(str(out / "drafter"), datasets["bf16"][0], 2, eval_fraction=0.25)
    assert ev8["count_0"] == ev16["count_0"] > 0
    assert abs(ev8["acc_0"] - ev16["acc_0"]) <= 0.05
