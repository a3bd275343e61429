"""bench/kda_configs.py: the subset of KDA decode configs whose best time per key comes closest to every config's."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kda_configs  # noqa: E402


def _write(root: Path, name: str, key: list, times: dict) -> None:
    cfgs = [[{"kwargs": {"BV": bv, "MERGED": m}, "num_warps": w}, [ms, ms, ms]] for (bv, w, m), ms in times.items()]
    (root / name).mkdir()
    (root / name / "_kda_decode_kernel.autotune.json").write_text(json.dumps({"key": key, "configs_timings": cfgs}))


def test_the_subset_closest_to_every_configs_best(tmp_path, capsys):
    a, b, c = (8, 1, False), (16, 2, True), (64, 4, False)
    dtypes = ["torch.bfloat16"] * 12
    _write(tmp_path, "k1", [1, 6, 128, False, *dtypes], {a: 1.0, b: 1.1, c: 2.0})
    _write(tmp_path, "k2", [9, 384, 128, True, *dtypes], {a: 3.0, b: 2.0, c: 1.0})
    _write(tmp_path, "k3", [9, 6, 128, True, *dtypes], {a: 1.2, b: 1.0, c: 3.0})
    # a step over pools in place (17 key entries, no all states): timings of the whole pool's restore, left out
    _write(tmp_path, "pool", [1, 6, 128, False, *dtypes, "torch.int64"], {a: 9.0, b: 9.0, c: 1.0})
    keys = kda_configs.load(str(tmp_path))
    assert len(keys) == 3
    assert kda_configs.score(keys, [a, b, c]) == (1.0, 1.0)
    worst, mean = kda_configs.score(keys, [b])
    assert worst == 2.0 and abs(mean - (1.1 + 2.0 + 1.0) / 3) < 1e-9
    assert kda_configs.main([str(tmp_path), "--sizes", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "1 configs: worst 2.000x, mean 1.367x: ((16, 2, True),)" in out  # a or c alone: 3x on a key
    assert "2 configs: worst 1.100x, mean 1.033x: ((16, 2, True), (64, 4, False))" in out
    assert "CONFIGS (2 of 8 tried here): worst 1.200x" in out  # a and c are among the autotuner's configs
    # the rule: (64, 4, False) at T = 1 over 6 heads is c (2.0x its best), (32, 2, False) at T = 9 is not tried
    assert kda_configs.kda_config(1, 6, 128) != c and kda_configs.kda_config(9, 384, 128) != c
    _write(tmp_path, "k4", [1, 96, 128, False, *dtypes], {a: 1.0, b: 1.5, c: 1.25})
    assert kda_configs.rule_score(kda_configs.load(str(tmp_path))) == (1.25, 1.25, 1.25, 1)
    assert len(kda_configs.load(str(tmp_path), pool_steps=True)) == 5  # a cache tuned on the rows' copies
