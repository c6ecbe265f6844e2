"""Draft vocabulary: counting loss-masked tokens from Parquet parts, and the d2t/t2d mapping."""
import collections
import os

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

from eagle3_ray.data import schema
from eagle3_ray.train import vocab

V, H = 50, 4
HIDDEN = ("aux_hidden_states", "last_hidden_states")


def make_rows(n: int, seed: int, prefix: str) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        s = int(rng.integers(3, 12))
        ids = rng.zipf(1.5, size=s) % V                    # skewed, like real text
        mask = (rng.random(s) < 0.6).astype(np.uint8)
        rows.append({"sample_id": f"{prefix}{i}", "input_ids": ids.astype(np.int32).tolist(),
                     "loss_mask": mask.tolist(), "num_tokens": s,
                     "aux_hidden_states": bytes(2 * 3 * H * s),
                     "last_hidden_states": bytes(2 * H * s)})
    return rows


def direct_counts(rows: list[dict]) -> np.ndarray:
    c = collections.Counter(t for r in rows for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    out = np.zeros(V, dtype=np.int64)
    for t, k in c.items():
        out[t] = k
    return out


@pytest.fixture
def dataset(tmp_path):
    """3 parts, several row groups each, plus a manifest; returns (dir, all rows)."""
    fs, root = pafs.LocalFileSystem(), str(tmp_path / "data")
    fs.create_dir(root)
    rows = []
    for p in range(3):
        part = make_rows(7 + p, seed=p, prefix=f"p{p}-")
        rows += part
        schema.write_part(fs, root, pa.Table.from_pylist(part, schema=schema.SCHEMA),
                          {"vocab_size": V}, row_group_bytes=300)
    schema.write_manifest(root, {"format": schema.FORMAT, "format_version": 1,
                                 "facts": {"vocab_size": V}})
    return root, rows


def test_counts_match_direct_count(dataset):
    root, rows = dataset
    parts = schema.list_parts(pafs.LocalFileSystem(), root)
    assert len(parts) == 3
    assert any(pq.ParquetFile(p).num_row_groups > 1 for p in parts)
    counts = vocab.count_tokens(root, V)
    assert counts.dtype == np.int64 and counts.shape == (V,)
    np.testing.assert_array_equal(counts, direct_counts(rows))
    np.testing.assert_array_equal(vocab.count_tokens("file://" + root, V), counts)   # URI


def test_counts_the_verifier_argmax_over_target_ids(tmp_path):
    """column="target_ids" counts the verifier's greedy token at the loss-masked positions
    (the drafter's targets), not the response tokens."""
    rows = make_rows(12, seed=3, prefix="t")
    rng = np.random.default_rng(5)
    for r in rows:                                 # a narrower distribution than the text's
        r["target_ids"] = rng.integers(0, 7, len(r["input_ids"])).astype(np.int32).tolist()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema.SCHEMA),
                   str(tmp_path / "part-t.parquet"), row_group_size=5)
    want = collections.Counter(t for r in rows for t, m in zip(r["target_ids"], r["loss_mask"])
                               if m)
    counts = vocab.count_tokens(str(tmp_path), V, column="target_ids")
    np.testing.assert_array_equal(counts, [want.get(i, 0) for i in range(V)])
    assert not np.array_equal(counts, vocab.count_tokens(str(tmp_path), V))   # input_ids
    with pytest.raises(ValueError, match="column"):
        vocab.count_tokens(str(tmp_path), V, column="sample_id")


def _garble_hidden_columns(path: str) -> None:
    """Overwrite the bytes of every hidden-state column chunk with garbage."""
    md = pq.ParquetFile(path).metadata
    spans = []
    for rg in range(md.num_row_groups):
        for c in range(md.num_columns):
            col = md.row_group(rg).column(c)
            if col.path_in_schema.startswith(HIDDEN):
                start = col.dictionary_page_offset if col.has_dictionary_page \
                    else col.data_page_offset
                spans.append((start, col.total_compressed_size))
    assert spans
    with open(path, "r+b") as f:
        for start, size in spans:
            f.seek(start)
            f.write(b"\xfe" * size)


def test_reads_only_ids_and_mask(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    rows = make_rows(20, seed=7, prefix="g")
    path = str(root / "part-garbled.parquet")
    pq.write_table(pa.Table.from_pylist(rows, schema=schema.SCHEMA), path, row_group_size=6)
    _garble_hidden_columns(path)
    with pytest.raises(Exception):                 # the hidden columns really are unreadable
        pq.read_table(path)
    np.testing.assert_array_equal(vocab.count_tokens(str(root), V), direct_counts(rows))


def test_bad_token_and_missing_dataset(tmp_path):
    with pytest.raises(FileNotFoundError, match="no part"):
        vocab.count_tokens(str(tmp_path), V)
    rows = make_rows(3, seed=1, prefix="b")
    rows[1]["input_ids"][0], rows[1]["loss_mask"][0] = V + 5, 1
    path = tmp_path / "part-bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema.SCHEMA), str(path))
    with pytest.raises(ValueError, match=rf"part-bad.parquet.*{V + 5}"):
        vocab.count_tokens(str(tmp_path), V)


def test_mapping_invariants_on_dataset(dataset):
    root, rows = dataset
    counts = vocab.count_tokens(root, V)
    for vd in (1, 7, 20, V):
        d2t, t2d = vocab.build_mapping(counts, vd)
        assert d2t.dtype == torch.int64 and d2t.shape == (vd,)
        assert t2d.dtype == torch.bool and t2d.shape == (V,) and int(t2d.sum()) == vd
        targets = vocab.draft_to_target(d2t)
        assert torch.equal(targets, torch.nonzero(t2d).flatten())        # ascending target ids
        vocab.check_mapping(d2t, t2d)
        # the kept tokens are a top-vd set: none left out is more frequent than one kept
        kept = counts[targets.numpy()]
        left = np.delete(counts, targets.numpy())
        assert left.size == 0 or left.max() <= kept.min()
    d2t, t2d = vocab.build_mapping(counts, 1)
    assert int(vocab.draft_to_target(d2t)[0]) == int(np.argmax(counts))


def test_ties_fill_identity_and_errors():
    counts = np.array([0, 3, 0, 3, 3, 7])
    d2t, t2d = vocab.build_mapping(counts, 3)     # 5 (7), then ties 1, 3 before 4
    assert vocab.draft_to_target(d2t).tolist() == [1, 3, 5]
    assert d2t.tolist() == [1, 2, 3]
    assert t2d.tolist() == [False, True, False, True, False, True]

    counts = np.zeros(10, dtype=np.int64)
    counts[[7, 9]] = [2, 5]
    d2t, t2d = vocab.build_mapping(counts, 4)     # 2 seen + lowest unseen ids 0, 1
    assert vocab.draft_to_target(d2t).tolist() == [0, 1, 7, 9]

    d2t, t2d = vocab.build_mapping(np.arange(10)[::-1], 10)
    assert d2t.tolist() == [0] * 10 and bool(t2d.all())

    for bad in (0, 11):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            vocab.build_mapping(np.ones(10), bad)
    d2t, t2d = vocab.build_mapping(np.arange(10), 4)
    with pytest.raises(ValueError, match="disagree"):
        vocab.check_mapping(d2t + 1, t2d)
    with pytest.raises(ValueError, match="int64"):
        vocab.check_mapping(d2t.to(torch.int32), t2d)


def test_coverage_and_main(dataset, capsys):
    root, rows = dataset
    counts = vocab.count_tokens(root, V)
    _, t2d = vocab.build_mapping(counts, V)
    assert vocab.coverage(counts, t2d) == 1.0
    cov = vocab.main(root, 5)
    _, t2d5 = vocab.build_mapping(counts, 5)
    assert cov == pytest.approx(counts[t2d5.numpy()].sum() / counts.sum())
    assert "covers" in capsys.readouterr().out
    assert os.path.basename(root) == "data"
