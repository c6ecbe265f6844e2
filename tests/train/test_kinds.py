"""The drafting-kind seam (eagle3_ray/train/kinds.py): a kind's loss is its unroll's, in training
(position sampling, recompute) and evaluating (every position measured); what each kind asks of
the settings."""
import pytest
import torch

from eagle3_ray.train import kinds, ttt
from test_ttt import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("drafting", ["chain", "parallel"])
def test_the_loss_of_chain_and_parallel_is_the_ttt_unroll(drafting):
    drafter, teacher, batch, _ = tiny(seed=3, drafting=drafting)
    settings = {"step_weight_decay": 0.7, "targets": "hard", "deep_fraction": 0.5,
                "cod_ratio": 0.5, "cod_min": 0.2, "recompute": False}
    torch.manual_seed(1)                       # the deep steps' positions are drawn
    loss, m = kinds.loss(drafter, teacher, batch, 4, **settings)
    torch.manual_seed(1)
    ref, m_ref = ttt.ttt_loss(drafter, teacher, batch, 4, 0.7, targets="hard", deep_fraction=0.5,
                              cod_ratio=0.5, cod_min=0.2, checkpoint_attention=False,
                              checkpoint_logits=False)
    assert torch.equal(loss, ref) and m == m_ref
    with torch.no_grad():                      # evaluating: every position, a probe step
        ev, m_ev = kinds.loss(drafter, teacher, batch, 4, **settings, evaluating=True,
                              loss_steps=3)
        full, m_full = ttt.ttt_loss(drafter, teacher, batch, 4, 0.7, targets="hard",
                                    loss_steps=3)
    assert torch.equal(ev, full) and m_ev == m_full
    assert m_ev["count"] != m["count"]         # the training call did sample


def test_each_kind_says_what_it_needs():
    kinds.check("chain", 1, "mla")
    with pytest.raises(ValueError, match="ttt_steps >= 2"):
        kinds.check("parallel", 1, "llama")
    with pytest.raises(ValueError, match="no engine runs a parallel MLA drafter"):
        kinds.check("parallel", 4, "mla")
    with pytest.raises(ValueError, match="drafting must be one of"):
        kinds.check("tree", 4, "llama")
    assert (kinds.min_depth("chain"), kinds.min_depth("parallel")) == (1, 2)
