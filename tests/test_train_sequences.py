"""Regeneration prompts in the chat template (data.regenerate.chat_prompts) and chat records."""
import pytest
import torch

from dspark.config import load_recipe
from tests.targets import add_tokenizer
from train.sequences import check_chat_template, encode_record, wrap_chat_prompts


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return add_tokenizer(tmp_path_factory.mktemp("tok"))


def test_a_share_of_prompts_becomes_user_turns_of_the_chat_template(tok):
    texts = ["def add(a, b):", "import os\n", "class Stack:", "x = [1, 2, 3]"]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    out = wrap_chat_prompts(prompts, 0.5, tok, torch.Generator().manual_seed(0))
    wrapped = [i for i, (a, b) in enumerate(zip(prompts, out)) if a != b]
    assert len(wrapped) == 2 and len(out) == 4
    for i in wrapped:
        assert tok.decode(out[i]) == f"<|im_start|>user\n{texts[i]}<|im_end|>\n<|im_start|>assistant\n"
    assert wrap_chat_prompts(prompts, 0.0, tok, torch.Generator().manual_seed(0)) == prompts
    assert all(a != b for a, b in zip(prompts, wrap_chat_prompts(prompts, 1.0, tok, torch.Generator())))


def test_chat_prompts_need_a_chat_template_and_regeneration(tok):
    r = load_recipe("recipes/quickstart.yaml", ["data.regenerate.chat_prompts=0.5"])
    check_chat_template(r, tok)  # the tokenizer has one: fine
    template, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(ValueError, match="data.regenerate.chat_prompts: the target tokenizer .* has no chat "
                                             "template"):
            check_chat_template(r, tok)
        check_chat_template(load_recipe("recipes/quickstart.yaml"), tok)  # not asked for: fine
    finally:
        tok.chat_template = template
    with pytest.raises(ValueError, match="chat_prompts: wraps regeneration prompts, so it needs "
                                         "data.regenerate.enabled=true"):
        load_recipe("recipes/quickstart.yaml", ["data.regenerate.chat_prompts=0.5", "data.regenerate.enabled=false"])
    with pytest.raises(ValueError, match=r"chat_prompts: expected a share in \[0, 1\]"):
        load_recipe("recipes/quickstart.yaml", ["data.regenerate.chat_prompts=2"])


def test_chat_records_mask_the_assistant_turns_only(tok):
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    ids, mask, prompt = encode_record(rec, tok)
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(mask)
    assert tok.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    user_turn = len(tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False))
    assert ids[:user_turn] == prompt[:user_turn] and not any(mask[:user_turn]) and all(mask[user_turn:])
    assert "hello there" in tok.decode([i for i, m in zip(ids, mask) if m])
