"""Which KDA decode configs the autotuner needs: from the timings Triton's autotuner stored for every config it tried.

    python bench/kda_configs.py runs/gpu/triton-autotune.tgz [--sizes 4,6,8] [--with-pool-steps]

Reads each `_kda_decode_kernel.autotune.json` of a saved autotune cache (`bench/run_gpu.sh` writes one per run:
$OUT/triton-autotune.tgz; the kernel is autotuned only under DSPARK_KDA_AUTOTUNE=1) and prints, per subset size, the
subset of the configs tried whose best time per key comes closest to the best of them all (worst, then mean ratio
over the keys), the same ratios for the autotuner's configs now (dspark.kernels.kda_decode.CONFIGS), and the worst,
median and mean ratio of the rule's pick (kda_config, what launches without autotuning). Each config the autotuner
keeps costs a compile per new kernel specialisation and a timing per new key, at a server's first start on a machine.
The keys of steps that write their final state into the pool in place are left out unless --with-pool-steps: a cache
saved before the autotuner timed them on the step's rows' copies (commit b25ab23) holds timings of the whole pool's
restore after every trial.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark.kernels.kda_decode import CONFIGS, kda_config  # noqa: E402

Config = tuple[int, int, bool]  # (BV, warps, MERGED)


def load(path: str, pool_steps: bool = False) -> list[tuple[tuple[int, int, int], dict[Config, float]]]:
    """Per tuned key: ((T, B*H, D), config -> median ms), from a .tgz of the cache or a directory (pool_steps: module
    doc)."""
    def parse(text: str):
        d = json.loads(text)
        key = d["key"]
        if not pool_steps and len(key) == 17 and key[3] is False:  # T, NH, D, ALL_STATES, 13 dtypes: slots, final
            return None
        return tuple(key[:3]), {(c["kwargs"]["BV"], c["num_warps"], bool(c["kwargs"]["MERGED"])): t[0]
                                for c, t in d["configs_timings"]}

    name = "_kda_decode_kernel.autotune.json"
    if Path(path).is_dir():
        texts = [p.read_text() for p in Path(path).rglob(name)]
    else:
        with tarfile.open(path) as tar:
            texts = [tar.extractfile(m).read().decode() for m in tar.getmembers() if m.name.endswith(name)]
    return [t for t in map(parse, texts) if t is not None]


def score(keys, subset) -> tuple[float, float]:
    """(worst, mean) over the keys of the subset's best time over the best time of every config tried."""
    r = [min(t[c] for c in subset) / min(t.values()) for _, t in keys]
    return max(r), sum(r) / len(r)


def rule_score(keys) -> tuple[float, float, float, int]:
    """(worst, median, mean, keys scored) of kda_config's pick over the best time of every config tried, on the keys
    where its pick was tried."""
    r = sorted(t[c] / min(t.values()) for shape, t in keys if (c := kda_config(*shape)) in t)
    if not r:
        return float("nan"), float("nan"), float("nan"), 0
    return r[-1], (r[(len(r) - 1) // 2] + r[len(r) // 2]) / 2, sum(r) / len(r), len(r)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cache", help="a saved autotune cache: .tgz or directory")
    p.add_argument("--sizes", default="2,4,6,8")
    p.add_argument("--with-pool-steps", action="store_true", help="keep the keys of steps over pools (module doc)")
    a = p.parse_args(argv)
    keys = load(a.cache, a.with_pool_steps)
    if not keys:
        p.error(f"{a.cache}: no _kda_decode_kernel timings in it")
    tried = sorted(set.intersection(*(set(t) for _, t in keys)))
    print(f"{len(keys)} keys, {len(tried)} configs tried on every key")
    for m in (int(x) for x in a.sizes.split(",")):
        best = min(itertools.combinations(tried, m), key=lambda s: score(keys, s))
        worst, mean = score(keys, best)
        print(f"{m} configs: worst {worst:.3f}x, mean {mean:.3f}x: {best}")
    now = [c for c in CONFIGS if c in tried]
    if now:
        worst, mean = score(keys, now)
        print(f"CONFIGS ({len(now)} of {len(CONFIGS)} tried here): worst {worst:.3f}x, mean {mean:.3f}x")
    worst, median, mean, n = rule_score(keys)
    print(f"kda_config's pick ({n} keys): worst {worst:.3f}x, median {median:.3f}x, mean {mean:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
