"""Code-completion points of Python sources: where a function's body begins. A HumanEval prompt (signature +
docstring) ends at such a point, and so does a file cut there: the model goes on to write the body.

    completion_points(text)                 -> sorted character offsets (each at the start of a line)
    completion_prompts(texts, tok, n_tokens) -> token ids of each point's last <= n_tokens tokens of context

A function's point is the end of its docstring's last line when it has a docstring, else the end of its signature
(the line before its first statement). Functions whose body starts on the `def` line, and files that do not parse,
give none.
"""
from __future__ import annotations

import ast

CHARS_PER_TOKEN = 8  # context cut before tokenizing: enough text for n_tokens tokens of any code


def completion_points(text: str) -> list[int]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    line_end, pos = [], 0  # line_end[i]: offset just past line i+1's newline
    for line in text.splitlines(keepends=True):
        pos += len(line)
        line_end.append(pos)
    points = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        if ast.get_docstring(node, clean=False) is not None:
            last = first.end_lineno  # through the docstring's closing line
        elif first.lineno > node.lineno:
            last = first.lineno - 1  # through the signature (and any comment lines before the body)
        else:
            continue  # `def f(): return 1`
        end = line_end[last - 1]
        if text[end - 1] == "\n":
            points.add(end)
    return sorted(points)


def completion_prompts(texts, tokenizer, n_tokens: int, bos_id: int | None = None) -> list[list[int]]:
    """For every completion point of every text: the last <= n_tokens token ids of the text before it. A cut inside
    the file drops its first (possibly partial) token; a context that reaches the file's start begins with bos_id
    (the separator pack_tokens puts between documents) when given."""
    tails, starts = [], []
    for text in texts:
        for p in completion_points(text):
            lo = max(0, p - CHARS_PER_TOKEN * n_tokens)
            tails.append(text[lo:p])
            starts.append(lo == 0)
    out = []
    for i in range(0, len(tails), 512):
        enc = tokenizer(tails[i:i + 512], add_special_tokens=False)["input_ids"]
        for ids, at_start in zip(enc, starts[i:i + 512]):
            ids = ([bos_id] if bos_id is not None else []) + ids if at_start else ids[1:]
            out.append(ids[-n_tokens:])
    return out


__all__ = ["completion_points", "completion_prompts"]
