"""The hidden-state dataset contract: Parquet columns, bf16 encoding, manifest, compatibility checks.

A dataset is a directory (local path or any URI pyarrow's filesystems take) holding
`part-<hash>.parquet` files and a `manifest.json`. One row per sample:

    sample_id          string          stable id derived from the source record
    input_ids          list<int32>     [S] tokens of the chat-templated conversation
    loss_mask          list<uint8>     [S] 1 exactly on assistant-content tokens
    num_tokens         int32           S
    aux_hidden_states  large_binary    bf16 [S, 3, H], token-major: inputs of the 3 aux layers
    last_hidden_states large_binary    bf16 [S, H]: output of the last decoder layer, *before*
                                        the final norm; the teacher is lm_head(norm(h))
    target_ids         list<int32>     [S] the verifier's greedy next token at each position
                                        (full-vocab argmax; format 2, absent in format 1)

That is 8·H bytes per token of hidden states, the floor for lossless bf16, in plain Arrow types
any Parquet reader understands; target_ids adds 4 and spares the trainer the full-vocab lm_head
(its teacher then needs only the draft-vocab rows). Dataset-level facts (verifier, layer ids and
their convention, dtype, chat template hash, ...) sit in each file's key-value metadata under
b"eagle3_ray" and in manifest.json, which also holds the extraction summary.

    python -c "import eagle3_ray.schema as s; print(s.read_manifest('runs/demo/data')['summary'])"
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

FORMAT = "eagle3_ray.hidden_states"
FORMAT_VERSION = 2                # 2 added target_ids; format 1 datasets still train
METADATA_KEY = b"eagle3_ray"
MANIFEST = "manifest.json"
# vLLM convention: aux layer id i is the hidden state at the *input* of decoder layer i
# (= transformers' output_hidden_states[i]). SGLang's config ids are i-1 for the same tensor.
LAYER_ID_CONVENTION = "vllm: input of decoder layer i (== HF hidden_states[i]; SGLang id i-1)"

SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.uint8())),
    ("num_tokens", pa.int32()),
    ("aux_hidden_states", pa.large_binary()),
    ("last_hidden_states", pa.large_binary()),
    ("target_ids", pa.list_(pa.int32())),
])

# Facts that must agree between every file of a dataset and between a dataset and its verifier.
IDENTITY_FIELDS = ("verifier_config_hash", "hidden_size", "vocab_size", "aux_layer_ids",
                   "layer_id_convention", "dtype", "chat_template_hash", "tokenizer_hash",
                   "max_length", "regenerate")


class DatasetMismatch(ValueError):
    """A dataset's facts disagree with the verifier/config it is used with."""


# --- bf16 <-> bytes ------------------------------------------------------------------------

def encode_bf16(t: torch.Tensor) -> bytes:
    """Any float tensor -> raw little-endian bf16 bytes (2 bytes per element)."""
    return t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()


def decode_bf16(buf: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bf16 bytes -> bf16 tensor of `shape` (copies, so the result is writable)."""
    arr = np.frombuffer(buf, dtype=np.int16).copy()
    if arr.size != int(np.prod(shape)):
        raise ValueError(f"hidden-state blob holds {arr.size} bf16 values, expected shape {shape}")
    return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)


def decode_row(row: dict, hidden_size: int) -> dict[str, torch.Tensor]:
    """One dataset row (as from pyarrow to_pylist / Ray Data) -> tensors for training."""
    s = int(row["num_tokens"])
    out = {
        "input_ids": torch.as_tensor(np.asarray(row["input_ids"], dtype=np.int64)),     # [S]
        "loss_mask": torch.as_tensor(np.asarray(row["loss_mask"], dtype=np.uint8)),     # [S]
        "aux_hidden_states": decode_bf16(row["aux_hidden_states"], (s, 3, hidden_size)),  # [S,3,H]
        "last_hidden_states": decode_bf16(row["last_hidden_states"], (s, hidden_size)),  # [S, H]
    }
    if row.get("target_ids") is not None:                                       # format >= 2
        out["target_ids"] = torch.as_tensor(np.asarray(row["target_ids"], dtype=np.int64))  # [S]
    return out


# --- filesystem helpers ---------------------------------------------------------------------

def resolve_fs(uri: str) -> tuple[pafs.FileSystem, str]:
    """A local path or a URI (s3://, gs://, file://, ...) -> (pyarrow filesystem, path in it)."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def absolute(uri: str) -> str:
    """Local paths made absolute (Ray workers run in other working directories); URIs kept."""
    return uri if "://" in uri or not uri else os.path.abspath(uri)


def write_bytes_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Write via a temp name + move so readers never see a half-written file."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)


def write_part(fs: pafs.FileSystem, directory: str, table: pa.Table, facts: dict,
               row_group_bytes: int = 256 << 20) -> str:
    """Write one Parquet part atomically; its name derives from its sample ids, so a retried
    batch overwrites its own file instead of duplicating samples. Returns the file name."""
    ids = sorted(table.column("sample_id").to_pylist())
    name = "part-" + hashlib.sha1("\n".join(ids).encode()).hexdigest()[:20] + ".parquet"
    table = table.cast(SCHEMA).replace_schema_metadata({METADATA_KEY: json.dumps(facts)})
    row_bytes = max(1, table.nbytes // max(1, table.num_rows))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd",
                   row_group_size=max(1, row_group_bytes // row_bytes))
    write_bytes_atomic(fs, f"{directory}/{name}", sink.getvalue().to_pybytes())
    return name


def list_parts(fs: pafs.FileSystem, directory: str) -> list[str]:
    """Full paths of the finished part files (temp files of an interrupted write excluded)."""
    info = fs.get_file_info(directory)
    if info.type == pafs.FileType.NotFound:
        return []
    sel = pafs.FileSelector(directory, recursive=False)
    return sorted(f.path for f in fs.get_file_info(sel)
                  if f.type == pafs.FileType.File and f.base_name.startswith("part-")
                  and f.base_name.endswith(".parquet"))


def remove_temp_files(fs: pafs.FileSystem, directory: str) -> int:
    """Delete leftovers of writes that were interrupted before their atomic move."""
    if fs.get_file_info(directory).type == pafs.FileType.NotFound:
        return 0
    sel = pafs.FileSelector(directory, recursive=False)
    tmps = [f.path for f in fs.get_file_info(sel) if ".tmp-" in f.base_name]
    for p in tmps:
        fs.delete_file(p)
    return len(tmps)


def part_facts(fs: pafs.FileSystem, path: str) -> dict:
    """The dataset facts stored in one part file's key-value metadata."""
    with fs.open_input_file(path) as f:
        md = pq.read_schema(f).metadata or {}
    if METADATA_KEY not in md:
        raise DatasetMismatch(f"{path}: not an eagle3_ray hidden-state file (no {METADATA_KEY!r} metadata)")
    return json.loads(md[METADATA_KEY])


def read_column(fs: pafs.FileSystem, path: str, column: str) -> list:
    """One small column of a part file (e.g. sample_id), without touching the hidden states."""
    with fs.open_input_file(path) as f:
        return pq.read_table(f, columns=[column]).column(column).to_pylist()


def part_stats(fs: pafs.FileSystem, path: str) -> dict:
    """sample ids, token and loss-token counts, size, and whether it stores target_ids (format
    >= 2) of one part, hidden states unread."""
    import pyarrow.compute as pc
    with fs.open_input_file(path) as f:
        part = pq.ParquetFile(f)
        t = part.read(columns=["sample_id", "num_tokens", "loss_mask"])
        names = part.schema_arrow.names
    return {"sample_ids": t.column("sample_id").to_pylist(),
            "tokens": int(pc.sum(t.column("num_tokens")).as_py() or 0),
            "loss_tokens": int(pc.sum(pc.list_flatten(t.column("loss_mask"))).as_py() or 0),
            "bytes": fs.get_file_info(path).size, "target_ids": "target_ids" in names}


# --- manifest and checks --------------------------------------------------------------------

def manifest_path(uri: str) -> str:
    return uri.rstrip("/") + "/" + MANIFEST


def stores_target_ids(manifest: dict) -> bool:
    """Every part of the dataset has the target_ids column (extraction records it)."""
    return bool(manifest.get("summary", {}).get("target_ids"))


def write_manifest(uri: str, manifest: dict) -> None:
    fs, root = resolve_fs(uri)
    write_bytes_atomic(fs, f"{root}/{MANIFEST}", json.dumps(manifest, indent=2).encode())


def read_manifest(uri: str) -> dict:
    """Read and sanity-check a dataset's manifest.json; errors name the file."""
    fs, root = resolve_fs(uri)
    path = f"{root}/{MANIFEST}"
    try:
        with fs.open_input_stream(path) as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no manifest; is {uri} a finished eagle3_ray dataset "
                                "(rerun extraction to finish it)?") from None
    except json.JSONDecodeError as e:
        raise DatasetMismatch(f"{path}: not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT:
        raise DatasetMismatch(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise DatasetMismatch(f"{path}: format_version {manifest['format_version']} is newer "
                              f"than this eagle3_ray understands ({FORMAT_VERSION})")
    return manifest


def diff_facts(found: dict, expected: dict, fields=IDENTITY_FIELDS) -> list[str]:
    """Human-readable differences between two fact dicts on the identity fields."""
    return [f"{k}: dataset has {found.get(k)!r}, expected {expected.get(k)!r}"
            for k in fields if k in expected and found.get(k) != expected.get(k)]


def check_compatible(manifest_or_facts: dict, expected: dict, where: str,
                     fields=IDENTITY_FIELDS) -> None:
    """Raise DatasetMismatch naming `where` and every differing field."""
    facts = manifest_or_facts.get("facts", manifest_or_facts)
    diffs = diff_facts(facts, expected, fields)
    if diffs:
        raise DatasetMismatch(f"{where}: dataset does not match: " + "; ".join(diffs))
