"""Acceptance, speed and losslessness per task and drafter, from the engine's step logs or a server's counters.

Definitions (as Spec-Bench and vLLM's spec-decode counters use them):
- a verify step with n >= 1 drafts accepts a of them and commits a + 1 tokens (the bonus/correction included);
  tau = mean over those steps of (a + 1) (= 1 + accepted / num_drafts in vLLM's counters); alpha = sum a / sum n.
  Steps with no drafts (the engine's last steps, when max_tokens leaves no room) are left out, as in vLLM.
- per_position.unconditional[i] = P(a > i | slot i drafted) (vLLM: accepted_per_pos[i] / num_drafts);
  per_position.conditional[i] = P(a > i | a >= i, slot i drafted): the acceptance of draft i given its prefix was.
- token events: draft i of a step is *reached* when the drafts before it were accepted (i <= a, i < n); it is
  accepted when i < a. Its target entropy is the teacher-forced H at the generated position it proposes, which is
  the position of committed token g_s + i (g_0 = 1: the prefill emits the first token; g_{s+1} = g_s + a_s + 1).
- speed: batch 1, each prompt generated alone on a warmed engine, AR and the drafters interleaved prompt by prompt
  (so load from other processes hits them alike), the fastest of --repeats runs per prompt;
  tok/s = generated tokens / wall seconds; speedup = drafter tok/s / AR tok/s on the same prompts.
"""
from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from dspark.request import SamplingParams


# ------------------------------------------------------------------------------------------ step-log math
def repeat_share(ids: list[int], n: int = 4) -> float | None:
    """The share of a text's tokens that end an n-gram seen earlier in it: how much of a greedy output loops (a
    drafter accepts a loop's tokens easily). None for a text shorter than n."""
    if len(ids) < n:
        return None
    seen, hits = set(), 0
    for i in range(n - 1, len(ids)):
        g = tuple(ids[i - n + 1: i + 1])
        hits += g in seen
        seen.add(g)
    return hits / (len(ids) - n + 1)


def mean_repeats(outputs: list[list[int]]) -> float | None:
    """repeat_share averaged over the outputs long enough to have one (None: none is)."""
    xs = [r for r in map(repeat_share, outputs) if r is not None]
    return sum(xs) / len(xs) if xs else None


def step_stats(accepted: list[int], drafted: list[int]) -> dict:
    """tau, alpha and per-position acceptance from per-step (accepted, drafted) logs (steps with 0 drafts skipped)."""
    steps = [(a, n) for a, n in zip(accepted, drafted) if n > 0]
    if any(not 0 <= a <= n for a, n in steps):
        raise ValueError("step log: accepted drafts must be in 0..drafted")
    k = max((n for _, n in steps), default=0)
    reached = [sum(1 for a, n in steps if a >= i and n > i) for i in range(k)]
    slots = [sum(1 for _, n in steps if n > i) for i in range(k)]
    acc = [sum(1 for a, _ in steps if a > i) for i in range(k)]
    n_acc, n_draft = sum(a for a, _ in steps), sum(n for _, n in steps)
    return {
        "tau": 1 + n_acc / len(steps) if steps else None,
        "alpha": n_acc / n_draft if n_draft else None,
        "per_position": {"conditional": [acc[i] / reached[i] if reached[i] else None for i in range(k)],
                         "unconditional": [acc[i] / slots[i] for i in range(k)]},
        "num_steps": len(steps), "num_draft_tokens": n_draft, "num_accepted_tokens": n_acc,
    }


def prompt_steps(accepted: list[int], drafted: list[int]) -> tuple[int, int]:
    """One prompt's verify steps with drafts and the tokens they committed (a + 1 each): tau's parts."""
    steps = [a for a, n in zip(accepted, drafted) if n > 0]
    return len(steps), len(steps) + sum(steps)


def pooled_ratio_ci95(nums: list[list[float]], dens: list[list[float]], n_boot: int = 1000, seed: int = 0
                      ) -> list[float] | None:
    """95 % bootstrap CI of prod_j (sum nums[j] / sum dens[j]) over prompts (nums[j], dens[j]: one value per
    prompt, the same prompts in every j), resampling prompts jointly for every j. One pair: a pooled mean (tau =
    committed / steps, entropy = sum / tokens); two: a ratio of pooled means on the same prompts (tau_ratio_ci95)."""
    keep = [i for i in range(len(nums[0])) if all(d[i] > 0 for d in dens)]
    if len(keep) < 2:
        return None
    idx = np.random.default_rng(seed).integers(0, len(keep), size=(n_boot, len(keep)))
    stat = np.ones(n_boot)
    for num, den in zip(nums, dens):
        n, d = np.asarray(num, dtype=float)[keep], np.asarray(den, dtype=float)[keep]
        stat *= n[idx].sum(1) / d[idx].sum(1)
    return [float(np.quantile(stat, 0.025)), float(np.quantile(stat, 0.975))]


def tau_ratio_ci95(a: dict, b: dict) -> list[float] | None:
    """95 % CI of tau_a / tau_b from two drafters' per-prompt figures on the same prompts (report.json's
    "per_prompt": steps, committed), paired: a prompt's difficulty is shared."""
    return pooled_ratio_ci95([a["committed"], b["steps"]], [a["steps"], b["committed"]])


def token_events(accepted: list[int], drafted: list[int], entropies: list[float]) -> list[tuple[int, float, bool]]:
    """(draft position, target entropy there, accepted) for every reached draft of one request."""
    events, g = [], 1
    for a, n in zip(accepted, drafted):
        for i in range(min(a + 1, n)):
            if g + i < len(entropies):
                events.append((i, entropies[g + i], i < a))
        g += a + 1
    return events


def decile_edges(values: list[float], bins: int = 10) -> list[float]:
    """Quantile bin edges (duplicates merged, so low-entropy spikes give fewer, wider bins)."""
    if not values:
        return []
    return [float(x) for x in np.unique(np.quantile(np.asarray(values, dtype=float), np.linspace(0, 1, bins + 1)))]


def bin_index(x: float, edges: list[float]) -> int:
    """Bin of x for edges e_0 < ... < e_m: [e_i, e_{i+1}), the last bin closed; values outside clamp to the ends."""
    return int(min(max(np.searchsorted(edges, x, side="right") - 1, 0), max(len(edges) - 2, 0)))


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman rank correlation with average ranks for ties (None when either side is constant)."""
    if len(x) < 2:
        return None

    def ranks(v):
        v = np.asarray(v, dtype=float)
        order = np.argsort(v, kind="mergesort")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for u in np.unique(v):  # average the ranks of ties
            m = v == u
            r[m] = r[m].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


# ------------------------------------------------------------------------------------------ local runs
@dataclass
class Run:
    """One engine over one task's prompts."""
    token_ids: list[list[int]] = field(default_factory=list)
    accepted: list[list[int]] = field(default_factory=list)
    drafted: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tok_s(self) -> float | None:
        return self.num_tokens / self.seconds if self.seconds > 0 else None

    def add(self, out, seconds: float) -> None:
        self.token_ids.append(out.token_ids)
        self.accepted.append(out.accepted_per_step)
        self.drafted.append(out.num_drafts_per_step)
        self.seconds += seconds


def sampling(max_tokens: int, temperature: float, seed: int, index: int, ignore_eos: bool = False) -> SamplingParams:
    """Prompt `index` samples with seed + index (no seed when greedy), the same for AR and every drafter."""
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
                          seed=seed + index if temperature > 0 else None)


def generate_timed(engine, ids: list[int], params: SamplingParams, repeats: int = 1):
    """(output of the first run, the fastest of `repeats` wall times): batch 1, one prompt alone on the engine.
    The minimum is robust to other processes on a shared machine; outputs are identical across repeats (greedy, or
    seeded sampling)."""
    best, first = float("inf"), None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        out = engine.generate([ids], params)[0]
        best = min(best, time.perf_counter() - t0)
        first = first or out
    return first, best


@dataclass
class DrafterLog:
    """Everything pooled over tasks for one drafter (overall figures, bins, Spearman)."""
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    events: list[tuple[int, float, bool]] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------ remote (a server)
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line of a Prometheus text exposition (comments skipped)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        samples.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return samples


def spec_decode_counters(text: str) -> dict:
    """vLLM's spec-decode counters from /metrics text: `vllm:spec_decode_<name>[_total]`, summed over every label
    (model_name, engine, ...) except `position`, which indexes num_accepted_tokens_per_pos. `_created` series and
    other metrics are ignored. Missing counters read as 0."""
    out: dict = {k: 0.0 for k in SPEC_COUNTERS[:3]}
    per_pos: dict[int, float] = {}
    for name, labels, value in parse_prometheus(text):
        if not name.startswith("vllm:spec_decode_"):
            continue
        key = name[len("vllm:spec_decode_"):]
        key = key[: -len("_total")] if key.endswith("_total") else key
        if key == "num_accepted_tokens_per_pos" and "position" in labels:
            p = int(labels["position"])
            per_pos[p] = per_pos.get(p, 0.0) + value
        elif key in out:
            out[key] += value
    out["num_accepted_tokens_per_pos"] = [per_pos.get(i, 0.0) for i in range(max(per_pos, default=-1) + 1)]
    return out


def counters_delta(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS[:3]}
    a, b = after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"]
    d["num_accepted_tokens_per_pos"] = [a[i] - (b[i] if i < len(b) else 0.0) for i in range(len(a))]
    return d


def stats_from_counters(c: dict) -> dict:
    """tau = 1 + accepted / drafts, alpha = accepted / draft tokens, per-position from the per-pos counters."""
    drafts, pos = c["num_drafts"], c["num_accepted_tokens_per_pos"]
    prev = [drafts] + pos[:-1]
    return {
        "tau": 1 + c["num_accepted_tokens"] / drafts if drafts else None,
        "alpha": c["num_accepted_tokens"] / c["num_draft_tokens"] if c["num_draft_tokens"] else None,
        "per_position": {"conditional": [p / q if q else None for p, q in zip(pos, prev)],
                         "unconditional": [p / drafts if drafts else None for p in pos]},
        "num_steps": int(drafts), "num_draft_tokens": int(c["num_draft_tokens"]),
        "num_accepted_tokens": int(c["num_accepted_tokens"]),
    }


class Server:
    """A running OpenAI-compatible server with vLLM's /metrics (ours or vLLM)."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0):
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.timeout = timeout
        from openai import OpenAI

        self.client = OpenAI(base_url=self.url + "/v1", api_key="EMPTY", timeout=timeout, max_retries=0)
        try:
            self.model = model or self.client.models.list().data[0].id
        except Exception as e:  # noqa: BLE001 - any transport error means the same thing to the user
            raise ConnectionError(f"--server {url}: unreachable or not an OpenAI server ({type(e).__name__}: {e})") from None

    def counters(self) -> dict:
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=self.timeout) as r:
                return spec_decode_counters(r.read().decode("utf-8"))
        except OSError as e:
            raise ConnectionError(f"--server {self.url}: GET /metrics failed ({e})") from None

    def complete(self, prompt: str, max_tokens: int, temperature: float, seed: int | None) -> tuple[str, int]:
        import openai

        try:
            r = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens,
                                               temperature=temperature, seed=seed)
        except openai.APIConnectionError as e:
            raise ConnectionError(f"--server {self.url}: /v1/completions unreachable ({e})") from None
        except openai.APIStatusError as e:
            raise ValueError(f"--server {self.url}: /v1/completions answered {e.status_code}: {e.message}") from None
        usage = getattr(r, "usage", None)
        return r.choices[0].text, (usage.completion_tokens if usage is not None else 0)
