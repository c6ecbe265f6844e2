"""The draft vocabulary: token counts over loss-masked tokens -> (d2t, t2d) mapping.

The drafter's lm_head covers only the `draft_vocab_size` most frequent target tokens among the
loss-masked (assistant) tokens of the hidden-state dataset. Two tensors describe the choice,
in the format SpecForge writes and SGLang/vLLM read:

    d2t  int64 [Vd]  offsets: target_id = draft_id + d2t[draft_id]; draft ids follow ascending
                     target ids, so d2t is non-decreasing and d2t[0] = the smallest kept id
    t2d  bool  [V]   True for the target ids that are in the draft vocabulary (sum == Vd)

Facts (checked upstream, no code taken):
  - SpecForge specforge/data/preprocessing.py (generate_vocab_mapping_file,
    process_token_dict_to_mappings): counts `input_ids[loss_mask == 1]`, keeps the top
    draft_vocab_size tokens, sorts the kept ids ascending, d2t[i] = kept[i] - i,
    t2d[j] = j in kept; pads with unseen ids when fewer tokens were seen.
  - vLLM vllm/model_executor/models/llama_eagle3.py (compute_logits): target ids are
    `arange(draft_vocab_size) + draft_id_to_target_id` (the loaded `d2t`); `t2d` is skipped.
  - SGLang python/sglang/srt/models/llama_eagle3.py (load_weights):
    hot_token_id = d2t + arange(len(d2t)); `t2d` is skipped.

Counting streams the dataset's Parquet parts row group by row group and reads only the
`input_ids` and `loss_mask` columns, never the hidden states.

    python -m eagle3_ray.train.vocab runs/demo/data 32000     # prints the draft vocab's coverage
"""
from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from eagle3_ray.data import schema

COLUMNS_COUNTED = ("input_ids", "target_ids")   # count_tokens reads one of these + loss_mask


def _count_row_group(table: pa.Table, vocab_size: int, where: str,
                     column: str = "input_ids") -> np.ndarray:
    """Counts of `column`'s ids at the loss-masked positions of one row group -> int64 [V]."""
    ids_col, mask_col = table.column(column), table.column("loss_mask")
    same_len = pc.equal(pc.list_value_length(ids_col), pc.list_value_length(mask_col))
    if pc.any(pc.invert(same_len)).as_py():
        raise ValueError(f"{where}: {column} and loss_mask differ in length in some row")
    ids = pc.list_flatten(ids_col).to_numpy()                       # [N] all tokens
    mask = pc.list_flatten(mask_col).to_numpy()                     # [N]
    kept = ids[mask == 1].astype(np.int64)                          # [M] loss-masked tokens
    if kept.size and (kept.min() < 0 or kept.max() >= vocab_size):
        bad = int(kept.max() if kept.max() >= vocab_size else kept.min())
        raise ValueError(f"{where}: {column} id {bad} outside the vocabulary [0, {vocab_size})")
    return np.bincount(kept, minlength=vocab_size)                  # [V]


def count_tokens(dataset_uri: str, vocab_size: int, column: str = "input_ids") -> np.ndarray:
    """int64 [V] counts of each id of `column` over the loss-masked positions (loss_mask == 1)
    of every part of the dataset at `dataset_uri` (local path or URI): "input_ids" counts the
    response tokens (SpecForge's rule), "target_ids" the verifier's argmax there, i.e. exactly
    the tokens a greedy verifier asks the drafter to propose at those positions (ttt.py: the
    target at position u is the verifier's argmax at u, masked by loss_mask[u]). Hidden-state
    columns are never read."""
    if column not in COLUMNS_COUNTED:
        raise ValueError(f"column must be one of {COLUMNS_COUNTED}, got {column!r}")
    fs, root = schema.resolve_fs(dataset_uri)
    parts = schema.list_parts(fs, root)
    if not parts:
        raise FileNotFoundError(f"{dataset_uri}: no part-*.parquet files (is it a dataset?)")
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in parts:
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            for rg in range(pf.num_row_groups):
                table = pf.read_row_group(rg, columns=[column, "loss_mask"])
                counts += _count_row_group(table, vocab_size, f"{path} row group {rg}", column)
    return counts


def build_mapping(counts, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`draft_vocab_size` token ids by count (ties -> lower id; unseen ids fill up by
    lowest id) -> (d2t int64 [Vd], t2d bool [V]). Vd == V gives the identity (d2t all 0)."""
    counts = np.asarray(counts, dtype=np.int64)
    vocab_size = counts.shape[0]
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, {vocab_size}]")
    ids = np.arange(vocab_size, dtype=np.int64)
    order = np.lexsort((ids, -counts))             # [V] count descending, then id ascending
    kept = np.sort(order[:draft_vocab_size])       # [Vd] target ids, ascending = draft order
    d2t = torch.from_numpy(kept - ids[:draft_vocab_size])           # [Vd] int64 offsets
    t2d = torch.zeros(vocab_size, dtype=torch.bool)                 # [V]
    t2d[torch.from_numpy(kept)] = True
    return d2t, t2d


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """int64 [Vd] target id of every draft id (how SGLang/vLLM apply d2t)."""
    return torch.arange(d2t.shape[0], dtype=torch.int64) + d2t.to(torch.int64)


def check_mapping(d2t: torch.Tensor, t2d: torch.Tensor, where: str = "vocab mapping") -> None:
    """Raise ValueError naming `where` unless (d2t, t2d) are a consistent draft vocabulary."""
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        raise ValueError(f"{where}: d2t must be int64 [Vd], got {d2t.dtype} {list(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise ValueError(f"{where}: t2d must be bool [V], got {t2d.dtype} {list(t2d.shape)}")
    targets = draft_to_target(d2t)                                  # [Vd]
    if int(t2d.sum()) != d2t.shape[0] or not torch.equal(targets, torch.nonzero(t2d).flatten()):
        raise ValueError(f"{where}: d2t and t2d disagree (draft ids must map, in ascending "
                         "order, exactly onto the target ids where t2d is True)")


def coverage(counts, t2d: torch.Tensor) -> float:
    """Fraction of the counted (loss-masked) tokens whose id is in the draft vocabulary."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    return float(counts[t2d.numpy()].sum()) / total if total else 0.0


def main(dataset_uri: str, draft_vocab_size: int = 32000) -> float:
    """Count a dataset's loss-masked tokens, pick the draft vocab, print and return coverage."""
    vocab_size = int(schema.read_manifest(dataset_uri)["facts"]["vocab_size"])
    counts = count_tokens(dataset_uri, vocab_size)
    vd = min(int(draft_vocab_size), vocab_size)
    _, t2d = build_mapping(counts, vd)
    cov = coverage(counts, t2d)
    print(f"{dataset_uri}: {int(counts.sum())} loss-masked tokens, "
          f"{int((counts > 0).sum())} distinct of V={vocab_size}; "
          f"draft vocab {vd} covers {cov:.2%}")
    return cov


if __name__ == "__main__":
    main(*sys.argv[1:2], *[int(a) for a in sys.argv[2:3]])
