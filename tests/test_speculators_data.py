"""Our regenerated training rows + the target's features in speculators' data format: speculators' own dataset
reader and collator read back exactly our rows, masks and (bf16) features, split train / holdout as ours."""
import json

import pytest
import torch
from speculators.train.data import ArrowDataset, CollateFn  # a dev dependency (the Makefile installs it)

from dspark.checkpoint import load_target
from train.sequences import Sequences
from train.speculators_data import export, main

LAYER_IDS = [0]  # the tiny pair's target has 2 layers: aux after layer 0, then the last layer (1) pre-norm


def sequences(vocab: int, seed: int = 0) -> tuple[Sequences, list[int]]:
    """Rows like load_sequences writes them: prompt (mask False) + response (True), padded to a common length with
    mask False; one train row has no loss token (it is left out). Returns them and the true lengths of train+holdout."""
    g = torch.Generator().manual_seed(seed)
    T = 40

    def split(n, lens):
        x = torch.zeros(n, T, dtype=torch.long)
        m = torch.zeros(n, T, dtype=torch.bool)
        for i, (p, n_tok) in enumerate(lens):
            x[i, :n_tok] = torch.randint(3, vocab, (n_tok,), generator=g)
            m[i, p:n_tok] = True
        return x, m

    train, train_mask = split(4, [(5, 40), (8, 31), (3, 3), (10, 25)])  # row 2: a prompt only
    holdout, holdout_mask = split(2, [(4, 40), (6, 22)])
    return Sequences(train, train_mask, holdout, holdout_mask), [40, 31, 25, 40, 22]


@pytest.fixture(scope="module")
def exported(models, tmp_path_factory):
    target_dir = models[0]
    target = load_target(target_dir)
    seqs, lens = sequences(target.config.vocab_size)
    out = tmp_path_factory.mktemp("spec-data") / "data"
    info = export(seqs, target, LAYER_IDS, out, batch_size=2, target_ref=str(target_dir))
    return target, seqs, lens, out, info


def expected_rows(target, seqs, lens):
    rows = [r for r, m in zip(torch.cat([seqs.train, seqs.holdout]), torch.cat([seqs.train_mask, seqs.holdout_mask]))
            if m.any()]
    masks = [m for m in torch.cat([seqs.train_mask, seqs.holdout_mask]) if m.any()]
    out = []
    for r, m, n in zip(rows, masks, lens):
        with torch.no_grad():
            logits, feats = target(r[None, :n], aux_layer_ids=[0, 1])
        out.append((r[:n], m[:n].long(), feats[0].view(n, 2, -1).to(torch.bfloat16), logits[0]))
    return out


def test_speculators_reader_gives_our_rows_and_features(exported):
    target, seqs, lens, out, info = exported
    assert info["train_rows"] == 3 and info["holdout_rows"] == 2 and info["speculators_target_layer_ids"] == [1]
    train = ArrowDataset(max_len=128, datapath=str(out), on_missing="raise", train_ratio=info["train_data_ratio"],
                         split="train")
    val = ArrowDataset(max_len=128, datapath=str(out), on_missing="raise", train_ratio=info["train_data_ratio"],
                       split="val")
    assert (len(train), len(val)) == (3, 2)
    items = [train[i] for i in range(3)] + [val[i] for i in range(2)]
    for item, (ids, mask, feats, logits) in zip(items, expected_rows(target, seqs, lens)):
        assert torch.equal(item["input_ids"], ids) and torch.equal(item["loss_mask"], mask)
        assert item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"], feats[:, :1].flatten(1))  # aux layers, concatenated
        assert torch.equal(item["verifier_last_hidden_states"], feats[:, 1])  # the last layer, before the norm
        # what speculators makes its soft targets from: the target's norm + LM head on it = the target's logits
        soft = target.lm_head(target.model.norm(item["verifier_last_hidden_states"].float()))
        assert (soft.argmax(-1) == logits.argmax(-1)).float().mean() > 0.9


def test_speculators_collator_packs_the_rows(exported):
    target, _, lens, out, info = exported
    ds = ArrowDataset(max_len=128, datapath=str(out), on_missing="raise", train_ratio=info["train_data_ratio"])
    H = target.config.hidden_size
    batch = CollateFn(max_len=128, hidden_size=H, num_target_layers=len(LAYER_IDS))([ds[i] for i in range(3)])
    assert batch["hidden_states"].shape == (1, 128, len(LAYER_IDS) * H)
    assert batch["verifier_last_hidden_states"].shape == (1, 128, H)
    n = sum(lens[:3])
    assert int((batch["document_ids"] >= 0).sum()) == n and batch["document_ids"][0, :n].unique().tolist() == [0, 1, 2]


def test_cli_and_errors(models, tmp_path, capsys):
    target_dir = models[0]
    seqs, _ = sequences(load_target(target_dir).config.vocab_size)
    torch.save(vars(seqs), tmp_path / "sequences.pt")
    out = tmp_path / "data"
    args = [str(tmp_path), "--target", str(target_dir), "--layer-ids", "0", "--out", str(out), "--device", "cpu"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 5
    assert main(args) == 2 and "--overwrite" in capsys.readouterr().err  # exists
    assert main([*args[:4], "1", "0", *args[5:], "--overwrite"]) == 2
    assert "--layer-ids: [1, 0]" in capsys.readouterr().err
    assert main([str(tmp_path / "nope"), *args[1:]]) == 2
    assert "sequences.pt" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "sequences.pt"]  # nothing half-written
