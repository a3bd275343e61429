"""Our Qwen3 against transformers' Qwen3ForCausalLM on the same weights, plus the cache and aux contracts."""
import json

import pytest
import torch
from transformers import Qwen3ForCausalLM as HFQwen3

from dspark.cache.batch import DenseCache
from dspark.checkpoint import load_target
from dspark.checkpoint_io import checkpoint_state
from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    cfg = qwen3_config(vocab_size=300, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=96, rope_theta=5000.0)
    model = Qwen3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("q3") / "ckpt"
    model.save_pretrained(path)
    return model, path


def test_logits_match_transformers(tiny):
    model, path = tiny
    hf = HFQwen3.from_pretrained(str(path)).eval()
    ids = torch.randint(0, 300, (2, 23))
    with torch.no_grad():
        assert torch.allclose(model(ids), hf(ids).logits, atol=1e-5)
    # weights name for name (the checkpoint's names: q/k/v and gate/up are merged in memory)
    assert set(hf.state_dict()) == set(checkpoint_state(model))


def test_save_load_round_trip(tiny):
    model, path = tiny
    loaded = load_target(path)
    assert isinstance(loaded, Qwen3ForCausalLM)
    ids = torch.randint(0, 300, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert json.loads((path / "config.json").read_text())["rope_parameters"]["rope_theta"] == 5000.0


def test_aux_hidden_states_after_layer_i(tiny):
    """vLLM semantics: id i = the hidden state after decoder layer i (HF hidden_states[i + 1]), pre-norm."""
    model, path = tiny
    hf = HFQwen3.from_pretrained(str(path)).eval()
    ids = torch.randint(0, 300, (2, 11))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
        logits, aux = model(ids, aux_layer_ids=[0, 1])
    assert aux.shape == (2, 11, 128)
    assert torch.allclose(aux[..., :64], hs[1], atol=1e-5)
    assert torch.allclose(aux[..., 64:], hs[2], atol=1e-5)
    with pytest.raises(ValueError, match="out of range.*0..2"):
        model(ids, aux_layer_ids=[3])
    with pytest.raises(ValueError, match="increasing"):
        model(ids, aux_layer_ids=[1, 0])


def test_incremental_decode_matches_full_forward(tiny):
    """Prefill of different lengths (right-padded batch), then decode and a multi-token verify step."""
    model, _ = tiny
    ids = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        full = model(ids)
        cache = DenseCache(2, 32)
        x = torch.zeros(2, 9, dtype=torch.long)
        x[0], x[1, :6] = ids[0, :9], ids[1, :6]
        out = model(x, batch=cache.batch([9, 6]))
        cache.commit()
        assert torch.allclose(out[0], full[0, :9], atol=1e-5)
        assert torch.allclose(out[1, :6], full[1, :6], atol=1e-5)
        pos = [9, 6]
        for _ in range(3):  # single-token decode
            x = torch.stack([ids[0, pos[0]:pos[0] + 1], ids[1, pos[1]:pos[1] + 1]])
            out = model(x, batch=cache.batch([1, 1]))
            cache.commit()
            for b in range(2):
                assert torch.allclose(out[b, 0], full[b, pos[b]], atol=1e-5)
            pos = [p + 1 for p in pos]
        # a verify-like step: 4 new tokens, keep 2 of row 0 and 4 of row 1, then continue
        x = torch.stack([ids[0, pos[0]:pos[0] + 4], ids[1, pos[1]:pos[1] + 4]])
        out = model(x, batch=cache.batch([4, 4], record=True))
        cache.commit([2, 4])
        assert torch.allclose(out[0], full[0, pos[0]:pos[0] + 4], atol=1e-5)
        pos = [pos[0] + 2, pos[1] + 4]
        x = torch.stack([ids[0, pos[0]:pos[0] + 1], ids[1, pos[1]:pos[1] + 1]])
        out = model(x, batch=cache.batch([1, 1]))
        for b in range(2):
            assert torch.allclose(out[b, 0], full[b, pos[b]], atol=1e-5)


def test_tied_embeddings_round_trip(tmp_path):
    cfg = qwen3_config(vocab_size=50, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=64, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(tmp_path / "t")
    loaded = load_target(tmp_path / "t")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
