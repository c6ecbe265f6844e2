"""The hidden-state dataset contract: Parquet columns, bf16/fp8 encoding, manifest, compatibility checks.

A dataset is a directory (local path or any URI pyarrow's filesystems take) holding
`part-<hash>.parquet` files and a `manifest.json`. One row per sample:

    sample_id          string          stable id derived from the source record
    input_ids          list<int32>     [S] tokens of the chat-templated conversation
    loss_mask          list<uint8>     [S] 1 exactly on assistant-content tokens
    num_tokens         int32           S
    aux_hidden_states  large_binary    [S, 3, H], token-major: inputs of the 3 aux layers
    last_hidden_states large_binary    [S, H]: output of the last decoder layer, *before*
                                        the final norm; the teacher is lm_head(norm(h))
    target_ids         list<int32>     [S] the verifier's greedy next token at each position
                                        (full-vocab argmax; format 2, absent in format 1)
    aux_hidden_scales  large_binary    float32 [S, 3]: fp8 storage only (format 3), one scale
    last_hidden_scales large_binary    float32 [S]     per H-vector (token x slot)

The hidden-state storage (a dataset fact, `hidden_storage`; absent = "bf16"):
  bf16      the two state columns hold raw little-endian bf16: 8·H bytes per token for the 4
            slots, the floor for lossless bf16.
  fp8_e4m3  they hold float8_e4m3fn bytes of x / scale, scale = amax(|x|) / 448 per H-vector
            (1 for an all-zero one), and the scale columns hold the scales: 4·H + 16 bytes
            per token (0.50 of bf16 at H=576). Relative error per element <= 2^-4 (e4m3's 3
            mantissa bits), at most scale·2^-10 absolute for the tiniest (e4m3 subnormal) ones;
            zeros stay zero. Format version 3; a reader older than that refuses the dataset.
decode_row tells the two apart by the scale columns and returns bf16 tensors either way, so
every reader (feed.collate, evaluate_drafter, ...) sees the same batch.

All plain Arrow types any Parquet reader understands; target_ids adds 4 bytes per token and
spares the trainer the full-vocab lm_head (its teacher then needs only the draft-vocab rows).
Dataset-level facts (verifier, layer ids and their convention, dtype, hidden storage, chat
template hash, ...) sit in each file's key-value metadata under b"eagle3_ray" and in
manifest.json, which also holds the extraction summary.

    python -c "from eagle3_ray.data import schema; \
print(schema.read_manifest('runs/demo/data')['summary'])"
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
FORMAT_VERSION = 3                # the newest this code reads: 2 added target_ids (format 1
                                  # datasets still train), 3 the fp8 hidden-state storage
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
# Hidden-state storages (the dataset fact "hidden_storage"); fp8 parts carry two more columns.
HIDDEN_STORAGES = ("bf16", "fp8_e4m3")
SCALE_COLUMNS = {"aux_hidden_states": "aux_hidden_scales",
                 "last_hidden_states": "last_hidden_scales"}
SCHEMA_FP8 = pa.schema(list(SCHEMA) + [pa.field(c, pa.large_binary())
                                       for c in SCALE_COLUMNS.values()])
FP8_MAX = 448.0                   # largest finite float8_e4m3fn

# Facts that must agree between every file of a dataset and between a dataset and its verifier.
IDENTITY_FIELDS = ("verifier_config_hash", "hidden_size", "vocab_size", "aux_layer_ids",
                   "layer_id_convention", "dtype", "chat_template_hash", "tokenizer_hash",
                   "max_length", "regenerate", "hidden_storage")
# What a fact missing from an older dataset's metadata means.
FACT_DEFAULTS = {"hidden_storage": "bf16"}


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


def check_storage(storage: str) -> str:
    if storage not in HIDDEN_STORAGES:
        raise ValueError(f"hidden storage must be one of {HIDDEN_STORAGES}, got {storage!r}")
    return storage


def schema_for(storage: str) -> pa.Schema:
    """The Parquet schema of a part holding hidden states in `storage`."""
    return SCHEMA_FP8 if check_storage(storage) == "fp8_e4m3" else SCHEMA


def format_version(storage: str) -> int:
    """The oldest format that describes a dataset in `storage`: bf16 datasets stay format 2,
    which every earlier reader with target_ids support reads; fp8 needs 3, so an older reader
    refuses it at the manifest instead of misreading fp8 bytes as bf16."""
    return 3 if check_storage(storage) == "fp8_e4m3" else 2


def hidden_bytes_per_token(hidden_size: int, storage: str) -> int:
    """Bytes of hidden states per token before compression: the storage's floor."""
    return 8 * hidden_size if check_storage(storage) == "bf16" else 4 * hidden_size + 16


def encode_hidden(t: torch.Tensor, storage: str) -> tuple[bytes, bytes | None]:
    """[..., H] float tensor -> (state bytes, scale bytes or None). bf16: raw bf16, no scales.
    fp8_e4m3: float8_e4m3fn bytes of x / scale and one float32 scale per H-vector (per token
    per slot), scale = amax(|x|) / 448, 1 where the vector is all zero."""
    if check_storage(storage) == "bf16":
        return encode_bf16(t), None
    x = t.detach().to("cpu", torch.float32)                                   # [..., H]
    amax = x.abs().amax(dim=-1, keepdim=True)                                 # [..., 1]
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("hidden state with inf/nan values cannot be stored as fp8_e4m3 "
                         "(use --hidden-storage bf16, or a verifier dtype that does not overflow)")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))      # [..., 1]
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)          # [..., H]
    return (q.contiguous().view(torch.uint8).numpy().tobytes(),
            scale.squeeze(-1).contiguous().numpy().astype("<f4").tobytes())     # [...] f32


def decode_fp8(buf: bytes, scales: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """fp8 bytes + float32 scales (one per vector along the last dim) -> bf16 tensor of
    `shape` (x = q * scale, computed in float32)."""
    q = np.frombuffer(buf, dtype=np.uint8)
    sc = np.frombuffer(scales, dtype="<f4")
    if q.size != int(np.prod(shape)) or sc.size != int(np.prod(shape[:-1])):
        raise ValueError(f"fp8 hidden-state blob holds {q.size} values and {sc.size} scales, "
                         f"expected shape {shape}")
    x = torch.from_numpy(q.copy()).view(torch.float8_e4m3fn).reshape(shape).float()
    return (x * torch.from_numpy(sc.copy()).reshape(*shape[:-1], 1)).to(torch.bfloat16)


def decode_hidden(row: dict, column: str, shape: tuple[int, ...]) -> torch.Tensor:
    """One hidden-state column of a row -> bf16 tensor; fp8 when the row has its scales."""
    scales = row.get(SCALE_COLUMNS[column])
    if scales is not None:
        return decode_fp8(row[column], scales, shape)
    return decode_bf16(row[column], shape)


def decode_row(row: dict, hidden_size: int) -> dict[str, torch.Tensor]:
    """One dataset row (as from pyarrow to_pylist / Ray Data) -> tensors for training. The
    hidden states come back bf16 whatever the storage (fp8 rows carry the scale columns)."""
    s = int(row["num_tokens"])
    out = {
        "input_ids": torch.as_tensor(np.asarray(row["input_ids"], dtype=np.int64)),     # [S]
        "loss_mask": torch.as_tensor(np.asarray(row["loss_mask"], dtype=np.uint8)),     # [S]
        "aux_hidden_states": decode_hidden(row, "aux_hidden_states", (s, 3, hidden_size)),
        "last_hidden_states": decode_hidden(row, "last_hidden_states", (s, hidden_size)),
    }                                                                 # [S, 3, H], [S, H] bf16
    if row.get("target_ids") is not None:                                       # format >= 2
        out["target_ids"] = torch.as_tensor(np.asarray(row["target_ids"], dtype=np.int64))  # [S]
    return out


def hidden_columns(names) -> list[str]:
    """The hidden-state columns (states + scales, when present) among `names`."""
    return [c for c in ("aux_hidden_states", "last_hidden_states", *SCALE_COLUMNS.values())
            if c in names]


# --- filesystem helpers ---------------------------------------------------------------------

def resolve_fs(uri: str) -> tuple[pafs.FileSystem, str]:
    """A local path or a URI (s3://, gs://, file://, ...) -> (pyarrow filesystem, path in it)."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def absolute(uri: str) -> str:
    """Local paths made absolute (Ray workers run in other working directories); URIs kept.
    Several datasets joined by commas (dataset_uris) are made absolute one by one."""
    if "," in uri:
        return ",".join(dataset_uris(uri))
    return uri if "://" in uri or not uri else os.path.abspath(uri)


def dataset_uris(dataset: str) -> list[str]:
    """A dataset argument -> its datasets: several extracted with the same verifier may be
    joined by commas ("runs/data/orig,runs/data/regen") and are read as one (read_datasets)."""
    uris = [absolute(u.strip()) for u in dataset.split(",") if u.strip()]
    if not uris:
        raise ValueError(f"no dataset in {dataset!r}")
    return uris


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
    target = schema_for(facts.get("hidden_storage", "bf16"))   # fp8: + the scale columns
    if target.names != table.column_names:
        raise ValueError(f"{directory}/{name}: columns {table.column_names} do not fit the "
                         f"{facts.get('hidden_storage', 'bf16')} schema {target.names}")
    table = table.cast(target).replace_schema_metadata({METADATA_KEY: json.dumps(facts)})
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
    """sample ids, token and loss-token counts, size, the compressed bytes of its hidden-state
    columns (scales included) and whether it stores target_ids (format >= 2) of one part,
    hidden states unread."""
    import pyarrow.compute as pc
    with fs.open_input_file(path) as f:
        part = pq.ParquetFile(f)
        t = part.read(columns=["sample_id", "num_tokens", "loss_mask"])
        names = part.schema_arrow.names
        md, hidden = part.metadata, set(hidden_columns(names))
        hidden_bytes = sum(md.row_group(g).column(c).total_compressed_size
                           for g in range(md.num_row_groups) for c in range(md.num_columns)
                           if md.row_group(g).column(c).path_in_schema in hidden)
    return {"sample_ids": t.column("sample_id").to_pylist(),
            "tokens": int(pc.sum(t.column("num_tokens")).as_py() or 0),
            "loss_tokens": int(pc.sum(pc.list_flatten(t.column("loss_mask"))).as_py() or 0),
            "bytes": fs.get_file_info(path).size, "hidden_bytes": hidden_bytes,
            "target_ids": "target_ids" in names}


# --- manifest and checks --------------------------------------------------------------------

def manifest_path(uri: str) -> str:
    return uri.rstrip("/") + "/" + MANIFEST


def hidden_storage(manifest_or_facts: dict) -> str:
    """A dataset's hidden-state storage ("bf16" for datasets from before the fact existed)."""
    facts = manifest_or_facts.get("facts", manifest_or_facts)
    return facts.get("hidden_storage", FACT_DEFAULTS["hidden_storage"])


def read_datasets(dataset: str, check=None) -> dict:
    """The manifest of one dataset, or of several joined by commas read as one: the first's
    facts, the summaries' counts summed (skip counts by reason too), every file with its full
    location ("uri"). check(uri, manifest) runs on each one first (train: the verifier facts)."""
    out = None
    for uri in dataset_uris(dataset):
        m = read_manifest(uri)
        if check is not None:
            check(uri, m)
        files = [dict(f, uri=f"{uri.rstrip('/')}/{f['name']}") for f in m["files"]]
        if out is None:
            out = dict(m, files=files, summary=dict(m.get("summary", {})))
            continue
        out["files"] += files
        for key in ("samples", "tokens", "loss_tokens", "bytes"):
            out["summary"][key] = out["summary"].get(key, 0) + m["summary"].get(key, 0)
        skipped = dict(out["summary"].get("skipped", {}))
        for reason, n in m["summary"].get("skipped", {}).items():
            skipped[reason] = skipped.get(reason, 0) + n
        out["summary"]["skipped"] = skipped
        out["summary"]["target_ids"] = stores_target_ids(out) and stores_target_ids(m)
    return out


def part_paths(uris: list[str]) -> list[tuple[pafs.FileSystem, str]]:
    """Full part locations (read_datasets's file "uri"s) -> (filesystem, path) each, one
    filesystem per dataset directory."""
    roots, out = {}, []
    for uri in uris:
        parent, name = uri.rsplit("/", 1)
        fs, root = roots.setdefault(parent, resolve_fs(parent))
        out.append((fs, f"{root}/{name}"))
    return out


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
    """Human-readable differences between two fact dicts on the identity fields (a fact an
    older dataset lacks counts as its FACT_DEFAULTS value)."""
    def get(facts, k):
        return facts.get(k, FACT_DEFAULTS.get(k))
    return [f"{k}: dataset has {get(found, k)!r}, expected {get(expected, k)!r}"
            for k in fields if (k in expected or k in FACT_DEFAULTS)
            and get(found, k) != get(expected, k)]


def check_compatible(manifest_or_facts: dict, expected: dict, where: str,
                     fields=IDENTITY_FIELDS) -> None:
    """Raise DatasetMismatch naming `where` and every differing field."""
    facts = manifest_or_facts.get("facts", manifest_or_facts)
    diffs = diff_facts(facts, expected, fields)
    if diffs:
        raise DatasetMismatch(f"{where}: dataset does not match: " + "; ".join(diffs))
