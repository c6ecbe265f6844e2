"""Served acceptance (quality.py) through the real decoder, and the bench's --set parsing."""
import pytest

from eagle3_ray import quality
from eagle3_ray.cli import parse_fields


@pytest.mark.usefixtures("one_thread")
def test_served_acceptance_accounts_for_every_round(tiny_verifier, tmp_path):
    """Greedy decoding of held-out prompts at depth 4 with the real Speculator: every round
    drafts 4 positions, acceptance is a chain (never more at k+1 than at k), and the tau that
    the per-position counts imply at the served depth equals the tokens per verify round that
    were measured."""
    from tests.test_serve import save_untrained
    drafter = save_untrained(tiny_verifier, str(tmp_path / "drafter"))
    s = quality.served_acceptance(drafter, prompts=2, max_tokens=12, depth=4)
    assert s["rounds"] > 0 and s["tokens"] >= s["rounds"]
    assert s["drafted_per_position"] == [s["rounds"]] * 4
    acc = s["accepted_per_position"]
    assert all(a >= b for a, b in zip(acc, acc[1:]))
    assert len(s["cond_acc"]) == 4 and len(s["tau_by_depth"]) == 5
    assert s["tau_by_depth"][4] == pytest.approx(s["acceptance_length"])


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
