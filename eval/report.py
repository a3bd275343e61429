"""`python -m eval` output: report.json (schema below), report.md, acceptance_vs_entropy.png,
acceptance_per_position.png.

report.json, SCHEMA_VERSION 1 (null where a figure does not apply: e.g. speedup and bins in --server mode):
{
  "schema_version": 1,
  "config": {"mode": "local" | "remote", "target": str | null, "server": str | null,
             "drafters": [{"name": str, "path": str | null, "mode": "dspark" | "dflash" | null,
                           "num_speculative_tokens": int | null}],
             "tasks": [str], "num_prompts": int | null, "max_tokens": int, "max_prompt_tokens": int,
             "temperature": float, "seed": int, "chat": bool, "repeats": int, "threads": int | null, "date": ISO-8601 UTC str,
             "versions": {"python": str, "torch": str, "transformers": str, "dspark": str, "git_commit": str | null,
                          "git_dirty": bool | null}},  # git_dirty: tracked files differ from git_commit
  "tasks": {<task>: {
      "entropy": float | null,            # mean teacher-forced target entropy (nats/token) on the AR output
      "entropy_ci95": [lo, hi] | null,    # bootstrap over prompts
      "num_prompts": int, "num_tokens": int,   # AR generated tokens
      "source": str, "chat": bool,
      "ar": {"tok_s": float | null, "seconds": float | null},
      "drafters": {<drafter>: {
          "tau": float | null,            # mean over verify steps with drafts of (accepted + 1)
          "tau_ci95": [lo, hi] | null,    # bootstrap over prompts (local mode)
          "per_prompt": {"steps": [int], "committed": [int]},  # per prompt: its verify steps with drafts and the
                                          # tokens they committed (tau's parts; local mode)
          "alpha": float | null,          # accepted / drafted tokens
          "per_position": {"conditional": [float | null],    # P(draft i accepted | drafts < i accepted)
                           "unconditional": [float | null]},  # P(draft i accepted | slot i drafted)
          "num_steps": int, "num_draft_tokens": int, "num_accepted_tokens": int, "num_tokens": int,
          "tok_s": float | null, "speedup": float | null,    # tok/s over AR tok/s, same prompts, batch 1
          "identical_to_ar": int | null,  # prompts whose greedy output equals AR's token for token (null if T > 0)
          "entropy": float | null}}}},    # mean target entropy on this drafter's own output
  "overall": {<drafter>: {"tau", "alpha", "per_position", "num_steps", "num_draft_tokens", "num_accepted_tokens",
                          "tok_s", "speedup", "identical_to_ar", "num_prompts"}},     # pooled over all tasks
  "entropy_bins": [{"lo": float, "hi": float,   # target-entropy deciles of all AR-generated tokens (nats)
                    "n": int,                   # AR-generated tokens in the bin
                    "n_per_drafter": {<drafter>: int},   # reached draft tokens (prefix accepted) in the bin
                    "acceptance_per_drafter": {<drafter>: float | null},  # P(accepted | reached) in the bin
                    "first_draft_acceptance_per_drafter": {<drafter>: float | null}}],  # verify steps whose first
                                                # draft position falls in the bin: P(first draft accepted)
  "spearman": {<drafter>: float | null}   # rho(entropy, accepted) over all reached draft tokens
}
"""
from __future__ import annotations

import json
from pathlib import Path

SCHEMA_VERSION = 1
FILES = ("report.json", "report.md", "acceptance_vs_entropy.png", "acceptance_per_position.png")


def entropy_bins(all_entropies: list[float], events: dict[str, list[tuple[int, float, bool]]], bins: int = 10
                 ) -> list[dict]:
    """Acceptance of reached draft tokens per target-entropy decile (deciles over all AR-generated tokens)."""
    from eval.measure import bin_index, decile_edges

    edges = decile_edges(all_entropies, bins)
    if len(edges) < 2:
        return []
    nb = len(edges) - 1
    out = [{"lo": edges[i], "hi": edges[i + 1], "n": 0, "n_per_drafter": {}, "acceptance_per_drafter": {},
            "first_draft_acceptance_per_drafter": {}} for i in range(nb)]
    for h in all_entropies:
        out[bin_index(h, edges)]["n"] += 1
    for name, evs in events.items():
        hit, tot, hit0, tot0 = [0] * nb, [0] * nb, [0] * nb, [0] * nb
        for pos, h, acc in evs:
            b = bin_index(h, edges)
            tot[b], hit[b] = tot[b] + 1, hit[b] + int(acc)
            if pos == 0:  # one event per verify step: its first draft, at the step's first position
                tot0[b], hit0[b] = tot0[b] + 1, hit0[b] + int(acc)
        for i in range(nb):
            out[i]["n_per_drafter"][name] = tot[i]
            out[i]["acceptance_per_drafter"][name] = hit[i] / tot[i] if tot[i] else None
            out[i]["first_draft_acceptance_per_drafter"][name] = hit0[i] / tot0[i] if tot0[i] else None
    return out


def _f(x, nd: int = 2, suffix: str = "") -> str:
    return "–" if x is None else f"{x:.{nd}f}{suffix}"


def sorted_tasks(report: dict) -> list[str]:
    """Task names by entropy ascending (tasks without an entropy last, by name)."""
    t = report["tasks"]
    return sorted(t, key=lambda n: (t[n]["entropy"] is None, t[n]["entropy"] or 0.0, n))


def markdown(report: dict) -> str:
    """One table: a row per task sorted by entropy, H, the outputs' 4-gram repeat share, prompts, tokens, AR tok/s,
    then tau / alpha / speedup per drafter."""
    names = [d["name"] for d in report["config"]["drafters"]]
    head = ["task", "H (nats)", "4-gram repeats", "prompts", "tokens", "AR tok/s"] + [f"τ {n}" for n in names] \
        + [f"α {n}" for n in names] + [f"speedup {n}" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "--:|" * (len(head) - 1)]
    for task in sorted_tasks(report):
        t = report["tasks"][task]
        d = t["drafters"]
        rep = t.get("repeats")
        row = [task, _f(t["entropy"], 3), "–" if rep is None else f"{rep:.1%}", str(t["num_prompts"]),
               str(t["num_tokens"]), _f(t["ar"]["tok_s"], 1)]
        row += [_f(d[n]["tau"]) for n in names] + [_f(d[n]["alpha"]) for n in names]
        row += [_f(d[n]["speedup"], 2, "×") for n in names]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _figure(ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(6.5 * ncols, 4.5), squeeze=False)
    for ax in axes[0]:
        ax.grid(alpha=0.3)
    return plt, fig, axes[0]


def plot_acceptance_vs_entropy(report: dict, path: Path) -> None:
    """Left: acceptance of reached drafts per entropy decile. Right: tau per task against the task entropy."""
    names = [d["name"] for d in report["config"]["drafters"]]
    plt, fig, (ax, ax2) = _figure(2)
    ax.set(title="Draft acceptance vs target entropy", xlabel="target entropy H (nats), decile bin centre",
           ylabel="P(draft accepted | prefix accepted)", ylim=(-0.02, 1.02))
    ax2.set(title="τ per task", xlabel="task entropy (nats/token)", ylabel="τ (tokens per verify step)")
    for j, name in enumerate(names):
        for key, style, label in (("acceptance_per_drafter", "-o", f"{name} all drafts (Spearman ρ="
                                   f"{_f(report['spearman'].get(name))})"),
                                  ("first_draft_acceptance_per_drafter", "--s", f"{name} first draft")):
            pts = [((b["lo"] + b["hi"]) / 2, b[key].get(name)) for b in report["entropy_bins"]]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{j}", label=label)
        tasks = [(t["entropy"], t["drafters"][name]["tau"], n) for n, t in report["tasks"].items()
                 if t["entropy"] is not None and t["drafters"][name]["tau"] is not None]
        if tasks:
            ax2.scatter([x for x, _, _ in tasks], [y for _, y, _ in tasks], color=f"C{j}", label=name)
            for x, y, n in tasks:
                ax2.annotate(n, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for a in (ax, ax2):
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_per_position(report: dict, path: Path) -> None:
    plt, fig, (ax,) = _figure(1)
    ax.set(title="Acceptance per draft position (all tasks)", xlabel="draft position i (0 = first draft)",
           ylabel="acceptance", ylim=(-0.02, 1.02))
    for j, (name, o) in enumerate(report["overall"].items()):
        for kind, style in (("conditional", "-o"), ("unconditional", "--s")):
            pts = [(i, y) for i, y in enumerate(o["per_position"][kind]) if y is not None]
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{j}", label=f"{name} {kind}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write the four report files to `out_dir` (created) and return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in FILES}
    paths["report.json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["report.md"].write_text(markdown(report))
    plot_acceptance_vs_entropy(report, paths["acceptance_vs_entropy.png"])
    plot_per_position(report, paths["acceptance_per_position.png"])
    return paths
