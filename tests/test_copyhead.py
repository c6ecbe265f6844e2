"""The seeded copy head (eagle3_ray/copyhead.py) on the real embedded verifier: fitted on the
verifier's aux states of real conversations, it attends where the current token occurred
before and raises the token that followed it there."""
import pytest
import torch

from eagle3_ray import copyhead, data, draft, train, verifier

SPEC = verifier.EMBEDDED_VERIFIER
# an unusual sentence said twice: in the second copy every next token is a copy from the first
SENTENCE = ("Seven purple kettles hummed beside the quiet harbour while Margot counted brass "
            "anchors for the winter fair.")

pytestmark = pytest.mark.usefixtures("one_thread")


def aux_states(model, layers, text_ids):
    ids = torch.tensor([text_ids])
    aux, _, _ = verifier.forward_hidden(model, ids, torch.ones_like(ids), layers)
    return aux[0].reshape(len(text_ids), -1).float()                        # [S, 3H]


def test_seeded_copy_head_looks_up_the_earlier_occurrence():
    cfg, tok = verifier.load_config(SPEC), verifier.load_tokenizer(SPEC)
    model = verifier.load_verifier(SPEC)
    layers = verifier.default_aux_layer_ids(cfg.num_hidden_layers)
    fit_ids = []
    for _, messages in data.iter_samples([data.EMBEDDED_SHAREGPT], limit=12):
        text = " ".join(m["content"] for m in messages)
        fit_ids += tok(text).input_ids[:400]
    fit_ids = fit_ids[:3000]
    aux_fit = aux_states(model, layers, fit_ids)
    c = draft.DraftConfig.from_verifier_config(cfg, cfg.vocab_size, layers)
    d2t = torch.zeros(c.vocab_size, dtype=torch.long)
    t2d = torch.ones(c.vocab_size, dtype=torch.bool)
    unseeded, _ = draft.build_drafter(SPEC, copyhead.with_copy_group(c), d2t, t2d, init="verifier")
    seeded, _ = draft.build_drafter(SPEC, copyhead.with_copy_group(c), d2t, t2d, init="verifier")
    facts = copyhead.seed_copy_head(seeded, aux_fit, torch.tensor(fit_ids))
    assert facts["tokens"] == len(fit_ids) and facts["code_r2"] > 0.5 and facts["key_r2"] > 0.5

    ids = tok(SENTENCE + " " + SENTENCE).input_ids
    s, n = len(ids), len(tok(" " + SENTENCE).input_ids)                     # second copy: s-n..
    aux = aux_states(model, layers, ids)[None]                              # [1, S, 3H]
    # drafter position t sees token x_{t+1} and predicts x_{t+2}
    tokens, pos = torch.tensor([ids[1:] + [ids[-1]]]), torch.arange(s)[None]
    c2 = seeded.config
    head = (c2.num_key_value_heads - 1) * (c2.num_attention_heads // c2.num_key_value_heads)
    with torch.no_grad():
        q, k, _ = seeded.qkv(tokens, seeded.fuse(aux), pos)
        lp_seeded = seeded.logits(seeded(tokens, aux, pos))[0].log_softmax(-1)
        lp_plain = unseeded.logits(unseeded(tokens, aux, pos))[0].log_softmax(-1)
    found, gain = 0, []
    for t in range(s - n, s - 2):                                            # in the second copy
        top = int((q[0, head, t] @ k[0, -1, :t + 1].T).argmax())            # the copy head's key
        found += top < s - n and ids[top] == ids[t + 1]     # an earlier occurrence of x_{t+1}
        gain.append(float(lp_seeded[t, ids[t + 2]] - lp_plain[t, ids[t + 2]]))
    # measured with the verifier in bf16: 13 of 20 found, +5.6 nats on average
    assert found >= 0.45 * len(gain), (found, len(gain))
    assert sum(gain) / len(gain) > 2.0, gain


def test_copy_head_needs_verifier_init_and_a_dataset_on_disk(tmp_path):
    with pytest.raises(ValueError, match="copy_head is seeded on top of init verifier"):
        train.check_config(train.TrainConfig(dataset="d", copy_head=True, init="random"))
    cfg = train.TrainConfig(dataset="", output=str(tmp_path), copy_head=True)
    manifest = {"facts": {"aux_layer_ids": [2, 15, 27]}, "files": []}         # online
    with pytest.raises(ValueError, match="online training has none"):
        train.make_setup(cfg, manifest, lambda: torch.ones(49152, dtype=torch.int64).numpy())
    with pytest.raises(ValueError, match="too few"):
        d, _ = draft.build_drafter(SPEC, copyhead.with_copy_group(
            draft.DraftConfig.from_verifier_config(verifier.load_config(SPEC), 64, [2, 15, 27])),
            torch.zeros(64, dtype=torch.long), torch.arange(49152) < 64, init="verifier")
        copyhead.seed_copy_head(d, torch.zeros(10, 3 * 576), torch.zeros(10, dtype=torch.long))
