"""python -m eval: step-log math, entropy, tasks, Prometheus parsing, and the CLI end to end on a tiny Qwen3."""
from __future__ import annotations

import glob
import json
import math
import subprocess
import sysconfig
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import datasets
import pytest
import torch

from eval import measure as M
from eval import report as R
from eval import tasks as T
from eval.__main__ import main, versions
from eval.entropy import entropy_of_logits, generated_entropies

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------ step-log math
def test_tau_alpha_per_position_from_step_logs():
    s = M.step_stats([2, 0, 3, 1, 0], [3, 3, 3, 3, 0])  # the last step had no drafts: left out, as in vLLM
    assert s["num_steps"] == 4 and s["num_draft_tokens"] == 12 and s["num_accepted_tokens"] == 6
    assert s["tau"] == pytest.approx(2.5) and s["alpha"] == pytest.approx(0.5)
    assert s["per_position"]["unconditional"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert s["per_position"]["conditional"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])


def test_step_stats_uneven_drafts_and_errors():
    s = M.step_stats([2, 1], [2, 4])  # slot 2, 3 drafted only in the second step; slot 2 never reached
    assert s["per_position"]["unconditional"] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert s["per_position"]["conditional"][:2] == pytest.approx([1.0, 0.5])
    assert s["per_position"]["conditional"][2:] == [None, None]  # a=2 reached slot 2 only where n=2 (not drafted)
    assert M.step_stats([], [])["tau"] is None
    with pytest.raises(ValueError):
        M.step_stats([3], [2])


def test_tau_ci_and_paired_ratio_resample_prompts():
    """A prompt's verify steps and committed tokens pool into tau; the CI resamples prompts, and a paired ratio of two
    drafters on the same prompts is exact where one commits twice the other's tokens on every prompt."""
    assert M.prompt_steps([2, 0, 3, 1], [4, 4, 4, 0]) == (3, 8)  # the step without drafts left out
    steps, committed = [4, 6, 5, 8], [12, 9, 20, 10]
    lo, hi = M.pooled_ratio_ci95([committed], [steps])
    assert lo < sum(committed) / sum(steps) < hi and min(c / n for c, n in zip(committed, steps)) <= lo
    assert hi <= max(c / n for c, n in zip(committed, steps))  # a pooled mean stays within the prompts' own
    pp = lambda c: {"steps": steps, "committed": c}  # noqa: E731
    assert M.tau_ratio_ci95(pp([2 * c for c in committed]), pp(committed)) == pytest.approx([2.0, 2.0])
    # one drafter a token short per prompt: the paired ratio stays within the prompts' own ratios c / (c - 1)
    lo, hi = M.tau_ratio_ci95(pp(committed), pp([c - 1 for c in committed]))
    assert 20 / 19 <= lo < hi <= 9 / 8
    assert M.pooled_ratio_ci95([[3]], [[1]]) is None and M.pooled_ratio_ci95([[3, 4]], [[0, 0]]) is None


def test_token_events_map_drafts_to_generated_positions():
    # prefill emits token 0; step 0 accepts 1 of 2 (commits tokens 1, 2); step 1 accepts 0 of 2 (commits token 3)
    ev = M.token_events([1, 0], [2, 2], [0.0, 1.0, 2.0, 3.0])
    assert ev == [(0, 1.0, True), (1, 2.0, False), (0, 3.0, False)]


def test_repeat_share_counts_tokens_that_end_an_earlier_ngram():
    assert M.repeat_share(list(range(20))) == 0.0  # no 4-gram twice
    loop = [1, 2, 3, 4, 5] * 6  # 30 tokens, 27 4-grams, the first 5 new
    assert M.repeat_share(loop) == pytest.approx(22 / 27)
    assert M.repeat_share([7, 7, 7]) is None  # shorter than one 4-gram
    assert M.mean_repeats([list(range(20)), loop, [1]]) == pytest.approx(11 / 27)


def test_spearman_with_ties_and_constant():
    assert M.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert M.spearman([1, 2, 3, 4], [1, 1, 0, 0]) == pytest.approx(-4 / (2 * math.sqrt(5)))
    assert M.spearman([1, 2, 3], [1, 1, 1]) is None


def test_entropy_bins_acceptance_falls_with_entropy():
    hs = [i / 100 for i in range(100)]
    events = {"d": [(0, h, h < 0.3) for h in hs] + [(1, h, h < 0.5) for h in hs]}
    bins = R.entropy_bins(hs, events)
    assert len(bins) == 10 and sum(b["n"] for b in bins) == 100 and all(b["n"] == 10 for b in bins)
    acc = [b["acceptance_per_drafter"]["d"] for b in bins]
    assert acc[:3] == [1.0] * 3 and acc[3:5] == [0.5] * 2 and acc[5:] == [0.0] * 5
    first = [b["first_draft_acceptance_per_drafter"]["d"] for b in bins]
    assert first[:3] == [1.0] * 3 and first[3:] == [0.0] * 7
    assert all(b["n_per_drafter"]["d"] == 20 for b in bins)
    assert bins[0]["lo"] == 0.0 and bins[-1]["hi"] == pytest.approx(0.99)


# ------------------------------------------------------------------------------------------ entropy
class FixedLogits(torch.nn.Module):
    def __init__(self, row):
        super().__init__()
        self.row = torch.nn.Parameter(torch.as_tensor(row, dtype=torch.float32), requires_grad=False)

    def forward(self, ids):
        return self.row.expand(ids.shape[0], ids.shape[1], -1)


def test_entropy_uniform_and_one_hot():
    V = 37
    hs = generated_entropies(FixedLogits(torch.zeros(V)), [1, 2], [3, 4, 5])
    assert len(hs) == 3 and hs == pytest.approx([math.log(V)] * 3, abs=1e-5)
    one_hot = torch.full((V,), -1e9)
    one_hot[4] = 0.0
    assert generated_entropies(FixedLogits(one_hot), [1], [4, 4]) == pytest.approx([0.0, 0.0], abs=1e-6)
    p = torch.tensor([0.5, 0.25, 0.25])
    assert float(entropy_of_logits(p.log())) == pytest.approx(1.5 * math.log(2), abs=1e-6)


# ------------------------------------------------------------------------------------------ tasks
def test_builtin_tasks_and_selection():
    he = T.build_task("humaneval")
    assert len(he.prompts) == 164 and he.prompts[0].startswith("from typing import List")
    for cat, n in [("math_reasoning", 80), ("qa", 80), ("writing", 10), ("coding", 10)]:
        assert len(T.build_task(cat).prompts) == n
    chat = T.build_task("chat")
    assert len(chat.prompts) == 80 and chat.chat
    picked = T.select(chat.prompts, 8)  # evenly spread: one per MT-Bench category
    cats = {r["turns"][0]: r["category"] for r in T.spec_bench_rows()}
    assert [cats[p] for p in picked] == list(T.MT_BENCH_CATEGORIES)
    assert T.select([1, 2, 3], 10) == [1, 2, 3] and T.select(list(range(10)), 2) == [0, 5]
    assert T.truncate_ids([1, 2, 3, 4, 5], 2) == [4, 5] and T.truncate_ids([1, 2], 5) == [1, 2]
    with pytest.raises(ValueError, match="valid: humaneval"):
        T.resolve_tasks(["nope"])
    with pytest.raises(ValueError, match="needs --corpus"):
        T.resolve_tasks(["code_holdout"])


def test_holdout_tasks_from_corpus():
    body = "".join(f"line {i} of the file\n" for i in range(60))
    rows = [("python_stdlib", "a.py", "def f():\n" + body), ("go_src", "b.go", "package x\n" + body),
            ("shakespeare", "h.txt", "HAMLET.\n" + body), ("fortunes", "f", "%\n" + body),
            ("python_stdlib", "short.py", "x = 1\n")]
    split = datasets.Dataset.from_dict({"source": [r[0] for r in rows], "path": [r[1] for r in rows],
                                        "text": [r[2] for r in rows]})
    corpus = datasets.DatasetDict({"train": split, "holdout": split})
    code = T.build_task("code_holdout", corpus)
    assert len(code.prompts) == 2  # the short file is skipped
    for p in code.prompts:
        assert p.endswith("\n") and 0.35 * len(body) < len(p) < 0.65 * len(body) + 12
    assert len(T.build_task("prose_holdout", corpus).prompts) == 2
    assert len(T.build_task("creative", corpus).prompts) == 20 + 2
    assert len(T.build_task("creative").prompts) == 20


def test_load_task_file(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "a"}\n{"task": "other", "prompt": "b", "chat": true}\n{"prompt": "c"}\n')
    tasks = {t.name: t for t in T.load_task_file(f)}
    assert tasks["mine"].prompts == ["a", "c"] and not tasks["mine"].chat
    assert tasks["other"].prompts == ["b"] and tasks["other"].chat
    g = tmp_path / "g.json"
    g.write_text(json.dumps([{"category": "x", "turns": ["t1", "t2"]}]))
    assert T.load_task_file(g)[0].prompts == ["t1"]
    (tmp_path / "bad.jsonl").write_text('{"task": "x"}\n')
    with pytest.raises(ValueError, match="row 0"):
        T.load_task_file(tmp_path / "bad.jsonl")


# ------------------------------------------------------------------------------------------ Prometheus / server
METRICS_OURS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 18.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="3"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 3.0
vllm:num_requests_running{model_name="m"} 0.0
"""


def test_prometheus_spec_decode_counters():
    c = M.spec_decode_counters(METRICS_OURS)
    assert (c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"]) == (10, 40, 18)
    assert c["num_accepted_tokens_per_pos"] == [8, 6, 3, 1]
    # vLLM without the suffix, two engines summed
    two = "\n".join(line.replace("_total", "") for line in METRICS_OURS.splitlines()
                    if "_created" not in line) + "\n" + METRICS_OURS.replace('engine="0"', 'engine="1"')
    c2 = M.spec_decode_counters(two)
    assert c2["num_drafts"] == 20 and c2["num_accepted_tokens_per_pos"] == [16, 12, 6, 2]
    s = M.stats_from_counters(M.counters_delta(M.spec_decode_counters(""), c))
    assert s["tau"] == pytest.approx(2.8) and s["alpha"] == pytest.approx(0.45)
    assert s["per_position"]["unconditional"] == pytest.approx([0.8, 0.6, 0.3, 0.1])
    assert s["per_position"]["conditional"] == pytest.approx([0.8, 0.75, 0.5, 1 / 3])


class _FakeServer(BaseHTTPRequestHandler):
    drafts = 0

    def _send(self, body: str, ctype="application/json"):
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/v1/models"):
            return self._send(json.dumps({"object": "list", "data": [{"id": "fake", "object": "model",
                                                                      "created": 0, "owned_by": "x"}]}))
        d = type(self).drafts  # each completion: 2 verify steps of 4 drafts, 3 accepted (2 at pos 0, 1 at pos 1)
        self._send(f'vllm:spec_decode_num_drafts_total{{model_name="fake"}} {2 * d}\n'
                   f'vllm:spec_decode_num_draft_tokens_total{{model_name="fake"}} {8 * d}\n'
                   f'vllm:spec_decode_num_accepted_tokens_total{{model_name="fake"}} {3 * d}\n'
                   f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {2 * d}\n'
                   f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {d}\n', "text/plain")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).drafts += 1
        self._send(json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": "fake",
                               "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
                               "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}))

    def log_message(self, *args):
        pass


def test_remote_mode_against_a_fake_server(tmp_path, capsys):
    httpd = HTTPServer(("127.0.0.1", 0), _FakeServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        rc = main(["--server", f"http://127.0.0.1:{httpd.server_port}", "--out", str(tmp_path),
                   "--tasks", "qa,humaneval", "--num-prompts", "3", "--max-tokens", "5"])
    finally:
        httpd.shutdown()
    assert rc == 0
    rep = json.loads((tmp_path / "report.json").read_text())
    for task in ("qa", "humaneval"):
        d = rep["tasks"][task]["drafters"]["server"]
        assert d["tau"] == pytest.approx(2.5) and d["alpha"] == pytest.approx(3 / 8) and d["num_steps"] == 6
        assert d["per_position"]["conditional"] == pytest.approx([1.0, 0.5])
        assert rep["tasks"][task]["num_tokens"] == 15
    assert rep["overall"]["server"]["num_steps"] == 12
    rc = main(["--server", "http://127.0.0.1:9", "--out", str(tmp_path), "--tasks", "qa"])
    assert rc == 2 and "unreachable" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ end to end
def build_tiny_models(root):
    """A random tiny Qwen3 target (+ BPE tokenizer on stdlib json/*.py) and random dspark / dflash drafters."""
    from dspark.checkpoint import export_drafter, load_drafter, load_target
    from dspark.data.tokenizer import train_tokenizer
    from dspark.models.drafter import DrafterConfig, DSparkDrafter
    from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config

    texts = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/json/*.py"))]
    tok = train_tokenizer(texts, 400, root / "tok")
    torch.manual_seed(0)
    cfg = qwen3_config(vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, max_position_embeddings=512, eos_token_id=tok.eos_token_id)
    target = Qwen3ForCausalLM(cfg).eval()
    target.save_pretrained(root / "target")
    tok.save_pretrained(str(root / "target"))
    common = dict(vocab_size=len(tok), hidden_size=64, target_hidden_size=64, target_layer_ids=[0, 1],
                  num_target_layers=2, mask_token_id=tok.mask_token_id, block_size=4, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
    emb, head = target.model.embed_tokens.weight, target.lm_head.weight
    export_drafter(DSparkDrafter(DrafterConfig(**common, markov_rank=8), emb, head), root / "dspark")
    export_drafter(DSparkDrafter(DrafterConfig(**common, mode="dflash", markov_rank=0, enable_confidence_head=False),
                                 emb, head), root / "dflash", layout="dflash")
    loaded = load_target(root / "target")
    assert load_drafter(root / "dspark", loaded).config.num_drafts == 4  # the exported dirs load back
    return root


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return build_tiny_models(tmp_path_factory.mktemp("eval_models"))


def test_cli_end_to_end(tiny_models, tmp_path, capsys):
    root, out = tiny_models, tmp_path / "rep"
    rc = main(["--target", str(root / "target"), "--drafter", str(root / "dspark"), "--drafter", str(root / "dflash"),
               "--name", "DSpark", "--name", "dflash", "--out", str(out), "--tasks", "humaneval,qa",
               "--num-prompts", "2", "--max-tokens", "8", "--max-prompt-tokens", "32", "--ignore-eos", "--threads", "1"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["schema_version"] == R.SCHEMA_VERSION
    assert {"target", "drafters", "num_prompts", "max_tokens", "temperature", "date", "versions"} <= set(rep["config"])
    assert [d["mode"] for d in rep["config"]["drafters"]] == ["dspark", "dflash"]
    assert set(rep["tasks"]) == {"humaneval", "qa"}
    for t in rep["tasks"].values():
        assert t["num_prompts"] == 2 and t["num_tokens"] == 16 and 0 < t["entropy"] <= math.log(400) + 1e-4
        assert t["ar"]["tok_s"] > 0 and 0.0 <= t["repeats"] <= 1.0
        for name, k in (("DSpark", 4), ("dflash", 3)):
            d = t["drafters"][name]
            assert d["identical_to_ar"] == 2  # greedy speculative decoding is lossless
            assert 1.0 <= d["tau"] <= k + 1 and 0.0 <= d["alpha"] <= 1.0 and d["speedup"] > 0
            assert len(d["per_position"]["conditional"]) == k and d["num_tokens"] == 16
            pp = d["per_prompt"]
            assert len(pp["steps"]) == 2 and sum(pp["steps"]) == d["num_steps"]
            assert sum(pp["committed"]) / sum(pp["steps"]) == pytest.approx(d["tau"])
            assert d["tau_ci95"][0] <= d["tau"] + 1e-9 and d["tau"] <= d["tau_ci95"][1] + 1e-9
            assert d["entropy"] == pytest.approx(t["entropy"])
    assert rep["overall"]["DSpark"]["identical_to_ar"] == 4
    bins = rep["entropy_bins"]
    assert bins and sum(b["n"] for b in bins) == 32 and all(b["lo"] <= b["hi"] for b in bins)
    assert set(bins[0]["acceptance_per_drafter"]) == {"DSpark", "dflash"}
    assert sum(b["n_per_drafter"]["DSpark"] for b in bins) >= rep["overall"]["DSpark"]["num_steps"]
    assert set(rep["spearman"]) == {"DSpark", "dflash"}
    for png in ("acceptance_vs_entropy.png", "acceptance_per_position.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    md = (out / "report.md").read_text().strip().splitlines()
    assert "τ DSpark" in md[0] and "τ dflash" in md[0] and "speedup DSpark" in md[0] and "H (nats)" in md[0]
    assert "4-gram repeats" in md[0]
    rows = md[2:]
    assert len(rows) == 2 and {r.split("|")[1].strip() for r in rows} == {"humaneval", "qa"}
    hs = [float(r.split("|")[2]) for r in rows]
    assert hs == sorted(hs)
    assert capsys.readouterr().out.strip().splitlines()[0] == md[0]  # the table is printed


def test_cli_errors(tiny_models, tmp_path, capsys):
    rc = main(["--target", str(tmp_path / "missing"), "--drafter", str(tiny_models / "dspark"), "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--target" in err and "no such directory" in err and len(err.splitlines()) == 1
    rc = main(["--target", str(tiny_models / "target"), "--drafter", str(tiny_models / "dspark"),
               "--out", str(tmp_path), "--tasks", "humaneval,bogus"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "'bogus'" in err and "humaneval" in err and "prose_holdout" in err


def test_cli_rejects_bad_options_before_loading(tiny_models, tmp_path, capsys, monkeypatch):
    import eval.__main__ as cli

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(cli, "run_local", no_load)
    base = ["--target", str(tiny_models / "target"), "--drafter", str(tiny_models / "dspark")]
    a_file = tmp_path / "report.txt"
    a_file.write_text("x")
    cases = [(["--out", str(tmp_path / "r"), "--tasks", ""], ["--tasks", "empty"]),
             (["--out", str(tmp_path / "r"), "--tasks", " , "], ["--tasks", "empty"]),
             (["--out", str(a_file)], ["--out", "is a file"]),
             (["--out", str(a_file / "sub")], ["--out", "is a file"]),
             (["--out", str(tmp_path / "r"), "--tasks", "humaneval,bogus,nope"], ["'bogus'", "'nope'", "humaneval"])]
    if not torch.cuda.is_available():
        cases.append((["--out", str(tmp_path / "r"), "--device", "cuda"], ["--device cuda", "no CUDA device"]))
    for extra, needles in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(n in err for n in needles), (extra, err)
    assert not (tmp_path / "r").exists()
    for bad in (["--engine", "static"], ["--dtype", "float8"]):  # --engine is gone; dtype has choices
        with pytest.raises(SystemExit) as e:
            main(base + ["--out", str(tmp_path / "r")] + bad)
        assert e.value.code == 2
    a = cli.parse_args(base + ["--out", str(tmp_path)])
    assert (a.device, a.dtype) == ("auto", "auto")



def test_versions_name_the_commit_and_whether_tracked_files_differ_from_it(tmp_path):
    """A report's versions carry the checkout's commit and git_dirty: whether tracked files differ from it (a copy of
    a newer tree under an older .git names the wrong commit otherwise); untracked files do not count; outside a
    checkout both are None."""
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    assert (versions(tmp_path)["git_commit"], versions(tmp_path)["git_dirty"]) == (None, None)
    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("commit", "-qm", "one")
    v = versions(tmp_path)
    assert len(v["git_commit"]) == 40 and v["git_dirty"] is False
    (tmp_path / "notes.txt").write_text("untracked")
    assert versions(tmp_path)["git_dirty"] is False
    (tmp_path / "f.py").write_text("a = 2\n")
    assert versions(tmp_path) == {**v, "git_dirty": True}
