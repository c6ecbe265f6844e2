"""Reading, normalizing and tokenizing conversations (no Ray)."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import CONVERSATIONS, USABLE_TEXTS
from eagle3_ray.data import conversations as data


def test_truncated_json_array_is_recovered(sharegpt_file):
    stats = data.ReadStats()
    got = list(data.iter_samples([sharegpt_file], stats=stats))
    assert [sid.split(":")[1] for sid, _ in got] == ["0", "1", "4"]
    assert stats.kept == 3
    assert stats.skipped == {"no_assistant_turn": 1, "empty": 1, "unknown_role": 1,
                             "truncated_file": 1}


def test_complete_json_array_has_nothing_dropped(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text(json.dumps(CONVERSATIONS))
    stats = data.ReadStats()
    assert len(list(data.iter_samples([str(p)], stats=stats))) == 3
    assert "truncated_file" not in stats.skipped


def test_small_read_chunks_match_one_big_read(sharegpt_file):
    """Records straddling chunk boundaries are recovered the same way."""
    whole = list(data._iter_json_array(sharegpt_file, data.ReadStats()))
    stats = data.ReadStats()
    chunked = list(data._iter_json_array(sharegpt_file, stats, chunk_chars=37))
    assert chunked == whole and len(whole) == 6 and stats.skipped["truncated_file"] == 1


def test_openai_jsonl_and_parquet_inputs(tmp_path):
    msgs = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "hel"},
                                              {"type": "text", "text": "lo"}]}]
    jl = tmp_path / "m.jsonl"
    jl.write_text(json.dumps({"messages": msgs}) + "\n{not json\n\n"
                  + json.dumps({"messages": [{"role": "tool", "content": "x"}]}) + "\n")
    pq.write_table(pa.table({"conversations": [CONVERSATIONS[1]["conversations"]]}),
                   tmp_path / "c.parquet")
    pq.write_table(pa.table({"messages": [[msgs[1], {"role": "assistant", "content": "hello"}]]}),
                   tmp_path / "m.parquet")
    stats = data.ReadStats()
    got = dict(data.iter_samples([str(tmp_path)], stats=stats))
    assert len(got) == 3
    assert stats.skipped == {"malformed_json": 1, "unknown_role": 1}
    contents = sorted(m[-1]["content"] for m in got.values())
    assert contents == ["1, 2, 3, 4, 5", "hello", "hello"]


def test_parquet_without_conversation_column_names_the_file(tmp_path):
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="bad.parquet.*conversations"):
        list(data.iter_samples([str(tmp_path / "bad.parquet")]))


def test_missing_input_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        list(data.iter_samples([str(tmp_path / "nope.json")]))


def test_sample_ids_are_stable_and_limit_counts_usable(sharegpt_file):
    a = [s for s, _ in data.iter_samples([sharegpt_file])]
    b = [s for s, _ in data.iter_samples([sharegpt_file], limit=2)]
    assert b == a[:2] and len(set(a)) == len(a)


def test_offset_and_limit_select_a_slice_of_the_usable_conversations(sharegpt_file):
    a = [s for s, _ in data.iter_samples([sharegpt_file])]
    stats = data.ReadStats()
    b = [s for s, _ in data.iter_samples([sharegpt_file], limit=1, stats=stats, offset=1)]
    assert b == a[1:2] and stats.kept == 1 and stats.skipped["offset"] == 1
    assert [s for s, _ in data.iter_samples([sharegpt_file], offset=len(a))] == []
    with pytest.raises(ValueError, match="offset"):
        list(data.iter_samples([sharegpt_file], offset=-1))


def test_loss_mask_decodes_to_exactly_the_assistant_texts(sharegpt_file, tiny_tokenizer):
    for sid, messages in data.iter_samples([sharegpt_file]):
        ids, mask = data.tokenize_conversation(tiny_tokenizer, messages, max_length=4096)
        assert len(ids) == len(mask) and set(mask) <= {0, 1}
        runs, cur = [], []
        for t, m in zip(ids, mask):
            if m:
                cur.append(t)
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        decoded = [tiny_tokenizer.decode(r) for r in runs]
        assert decoded == USABLE_TEXTS[int(sid.split(":")[1])]
        # and everything else is template or user text
        full = tiny_tokenizer.decode(ids)
        assert full == tiny_tokenizer.apply_chat_template(messages, tokenize=False)


def test_truncation_and_nothing_left_to_learn(tiny_tokenizer):
    messages = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(data.SkipRecord, match="no_assistant_tokens_within_max_length"):
        data.tokenize_conversation(tiny_tokenizer, messages, max_length=64)
    messages[0]["content"] = "short"
    messages[1]["content"] = "long answer " * 100
    ids, mask = data.tokenize_conversation(tiny_tokenizer, messages, max_length=64)
    assert len(ids) == 64 and mask[-1] == 1 and mask[0] == 0


def test_embedded_sharegpt_recovers_complete_records():
    """The packaged ShareGPT V3 JSON is cut off mid-record: every complete record is read."""
    stats = data.ReadStats()
    n = sum(1 for _ in data.iter_samples([data.EMBEDDED_SHAREGPT], stats=stats))
    assert n == stats.kept > 17_000
    assert stats.skipped["truncated_file"] == 1
    assert n + sum(stats.skipped.values()) - 1 > 17_500  # complete records seen
