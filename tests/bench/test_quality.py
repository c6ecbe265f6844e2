"""Served acceptance (quality.py) through the real decoder, and the bench's --set parsing."""
import json
import os

import pytest

from eagle3_ray.bench import quality
from eagle3_ray.data import conversations as data, schema
from eagle3_ray.cli import parse_fields


@pytest.mark.usefixtures("one_thread")
def test_served_acceptance_accounts_for_every_round(tiny_verifier, tmp_path):
    """Greedy decoding of held-out prompts at depth 4 with the real Speculator: every round
    drafts 4 positions, acceptance is a chain (never more at k+1 than at k), and the tau that
    the per-position counts imply at the served depth equals the tokens per verify round that
    were measured."""
    from tests.serve.test_serve import save_untrained
    drafter = save_untrained(tiny_verifier, str(tmp_path / "drafter"))
    s = quality.served_acceptance(drafter, prompts=2, max_tokens=12, depth=4)
    assert s["rounds"] > 0 and s["tokens"] >= s["rounds"]
    assert s["drafted_per_position"] == [s["rounds"]] * 4
    acc = s["accepted_per_position"]
    assert all(a >= b for a, b in zip(acc, acc[1:]))
    assert len(s["cond_acc"]) == 4 and len(s["tau_by_depth"]) == 5
    assert s["tau_by_depth"][4] == pytest.approx(s["acceptance_length"])


def _dataset(path, inputs, limit, offset=0) -> str:
    """A finished dataset's manifest.json (no parts: check_unseen reads only the manifest)."""
    os.makedirs(path)
    schema.write_manifest(str(path), {"format": schema.FORMAT, "format_version": 2, "config": {
        "inputs": inputs, "sample_limit": limit, "sample_offset": offset}})
    return str(path)


def test_check_unseen_refuses_training_data_that_holds_the_heldout_prompts(tmp_path):
    """Served acceptance decodes conversations HELDOUT_FIRST.. HELDOUT_END-1; a drafter trained on
    a slice of the embedded ShareGPT that holds them is refused, naming the manifest and the
    slices. The slices benches use, user files and sources no longer on disk pass."""
    sharegpt = [data.EMBEDDED_SHAREGPT]
    first = _dataset(tmp_path / "first", sharegpt, data.HELDOUT_FIRST)
    rest = _dataset(tmp_path / "rest", sharegpt, 8000, offset=data.HELDOUT_END)
    by_hand = _dataset(tmp_path / "by_hand", sharegpt, 8000)
    own = _dataset(tmp_path / "own", [str(tmp_path / "chats.jsonl")], 8000)
    for ok in (first, f"{first},{rest}", own, str(tmp_path / "moved"), "online:x"):
        quality.check_unseen("d", {"dataset": ok})
    with pytest.raises(ValueError, match=r"by_hand/manifest.json: usable embedded ShareGPT "
                                         r"conversations 0 to 7,999.*5,000 to 5,499"):
        quality.check_unseen("d", {"dataset": f"{first},{by_hand}"})
    # online training: the run dir's online/source.json (all conversations: --limit unset)
    run = tmp_path / "run"
    os.makedirs(run / "online")
    meta = {"dataset": "online:embedded:sharegpt", "train_config": {"output": str(run)}}
    for skip, refused in ((0, True), (data.HELDOUT_END, False)):
        (run / "online" / "source.json").write_text(json.dumps(
            {"inputs": sharegpt, "limit": None, "skip": skip}))
        if refused:
            with pytest.raises(ValueError, match="source.json: .* 0 to the end"):
                quality.check_unseen("d", meta)
        else:
            quality.check_unseen("d", meta)


def test_served_acceptance_refuses_a_drafter_trained_on_the_heldout_prompts(tiny_verifier,
                                                                            tmp_path):
    from tests.serve.test_serve import save_untrained
    drafter = save_untrained(tiny_verifier, str(tmp_path / "drafter"))
    meta_path = os.path.join(drafter, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["dataset"] = _dataset(tmp_path / "data", [data.EMBEDDED_SHAREGPT], None)
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(ValueError, match="held-out prompts"):
        quality.served_acceptance(drafter, prompts=1, max_tokens=4, depth=2)


def test_set_fields_are_typed_and_checked():
    assert parse_fields(["lr=1e-3", "max_minutes=1.5", "init=random", "data=regen",
                         "batch_size=4", "use_gpu=true"]) == {
        "lr": 1e-3, "max_minutes": 1.5, "init": "random", "data": "regen", "batch_size": 4,
        "use_gpu": True}
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        parse_fields(["learning_rate=1"])


def test_recipe_arms_are_the_two_by_two():
    arms = quality.recipe_arms(4, lr=1e-3)
    assert set(arms) == {"random-orig", "verifier-orig", "random-regen", "verifier-regen"}
    assert all(a["ttt_steps"] == 4 and a["lr"] == 1e-3 for a in arms.values())
