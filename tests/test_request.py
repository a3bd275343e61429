"""Request.text: incremental detokenization equals a full decode of the output at every step."""
import random
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dspark.request import Request, SamplingParams, text_decoder
from tests.targets import add_tokenizer

MULTIBYTE = "naïve café — 東京の天気は晴れ 🌤️👩‍💻 Ωμέγα ∑∫≈ done.\n"


def _texts() -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[5:8]
    return [f.read_text(errors="replace")[:3000] for f in files] + [MULTIBYTE * 3]


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (Metaspace: '▁' for spaces, the first token's leading space dropped on decode)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(_texts(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


@pytest.fixture(scope="module")
def tokenizers_(tmp_path_factory):
    return {"byte-level": add_tokenizer(tmp_path_factory.mktemp("tok")), "metaspace": _metaspace_tokenizer()}


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
@pytest.mark.parametrize("source", ["text", "random ids"])
def test_incremental_text_equals_full_decode(tokenizers_, kind, source):
    """Tokens arrive in chunks of 1-9 (as verify steps emit them); after each chunk the request's text is the full
    decode of its output so far, trailing partial characters ('\\ufffd') and special tokens included."""
    tok = tokenizers_[kind]
    rng = random.Random(0)
    for text in _texts():
        ids = tok.encode(text, add_special_tokens=False)[:600]
        if source == "random ids":  # byte tokens in any order: partial and invalid UTF-8 sequences
            ids = [rng.randrange(len(tok)) for _ in range(300)]
        req = Request([1], SamplingParams(max_tokens=1000), tokenizer=tok)
        while len(req.output_ids) < len(ids):
            req.output_ids += ids[len(req.output_ids): len(req.output_ids) + rng.randint(1, 9)]
            assert req.text == tok.decode(req.output_ids, skip_special_tokens=True)
        assert req.output().text == tok.decode(ids, skip_special_tokens=True)
    assert MULTIBYTE in req.text or source == "random ids"


def test_text_pinned_by_a_stop_string_cut(tokenizers_):
    """The engine cuts the text at a stop string: the cut text stays until more tokens arrive."""
    tok = tokenizers_["byte-level"]
    req = Request([1], SamplingParams(max_tokens=100), tokenizer=tok)
    req.output_ids += tok.encode("def f(x):\n    return x\n", add_special_tokens=False)
    assert req.text.endswith("return x\n")
    req.text = "def f(x):"
    assert req.text == "def f(x):" and req.output().text == "def f(x):"


@pytest.mark.parametrize("cleanup", [False, True])
def test_decoder_skips_transformers_wrapping_only_when_equal(tokenizers_, monkeypatch, cleanup):
    """A fast tokenizer decodes through its Rust backend, unless transformers would also clean up spaces: then the
    tokenizer's own decode runs. Either way the text is the tokenizer's decode."""
    tok = tokenizers_["metaspace"]
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", cleanup)
    ids = tok.encode(MULTIBYTE + " a , b . c ' d", add_special_tokens=False) + [tok.eos_token_id]
    want = tok.decode(ids, skip_special_tokens=True)
    calls = []
    monkeypatch.setattr(tok, "decode", lambda *a, **k: calls.append(a) or want)
    assert text_decoder(tok)(ids) == want
    assert bool(calls) == cleanup
