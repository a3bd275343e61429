"""serve_bench's summary: one row per (task, temperature, concurrency) with AR and DSpark (and serve_bench's
--variant: dspark-b, or ar-b where DSpark did not run) side by side, as a markdown table."""
from __future__ import annotations

import statistics

MODES = ("ar", "dspark", "dspark-b", "ar-b")
NAMES = {"ar": "AR", "dspark": "DSpark", "dspark-b": "DSpark-b", "ar-b": "AR-b"}


def rows(levels: list[dict]) -> list[dict]:
    """One row per (task, temperature, concurrency) with the modes side by side (each figure the median over the
    rounds), DSpark ÷ AR (the median of each round's ratio, every round's in `speedups`; where a variant ran, its
    mode in `variant` (dspark-b or ar-b), its ratio to AR in `speedup_b`, `speedups_b`, and to DSpark per round in
    `b_over_dspark`) and the greedy text check."""
    by: dict[tuple, list[dict]] = {}
    for lv in levels:
        by.setdefault((lv["mode"], lv["task"], lv["temperature"], lv["concurrency"]), []).append(lv)
    out = []
    for key in dict.fromkeys((lv["task"], lv["temperature"], lv["concurrency"]) for lv in levels):
        ar, ds = by.get(("ar", *key), []), by.get(("dspark", *key), [])
        variant = next((m for m in MODES[2:] if (m, *key) in by), None)
        dsb = by.get((variant, *key), [])
        row = {"task": key[0], "temperature": key[1], "concurrency": key[2], "ar": _brief(ar), "dspark": _brief(ds),
               "speedup": None, "speedups": [], "greedy_equal": None, "greedy_compared": None}
        row["cut"] = any(lv.get("cut_by_time_limit") for lv in ar + ds + dsb)  # a part of a level: no ratio
        row["speedups"] = [] if row["cut"] else per_round(ds, ar)
        row["speedup"] = statistics.median(row["speedups"]) if row["speedups"] else None
        if dsb:  # and the variant over DSpark round by round: the A/B's own figure, both under the same round's drift
            row["variant"], row[variant] = variant, _brief(dsb)
            row["speedups_b"], row["b_over_dspark"] = ([], []) if row["cut"] else (per_round(dsb, ar),
                                                                                  per_round(dsb, ds))
            row["speedup_b"] = statistics.median(row["speedups_b"]) if row["speedups_b"] else None
        if ar and ds and key[1] == 0:  # each DSpark text against the AR text of its prompt (levels differ in how
            # many requests they sent, and client processes report theirs in their own order)
            ar_text = {x["prompt"]: x["text"] for lv in ar for x in lv["per_request"] if x["ok"]}
            pairs = [(ar_text[y["prompt"]], y["text"]) for lv in ds for y in lv["per_request"]
                     if y["ok"] and y["prompt"] in ar_text]
            row["greedy_compared"] = len(pairs)
            row["greedy_equal"] = sum(x == y for x, y in pairs)
        out.append(row)
    return out


def per_round(lvs: list[dict], base: list[dict]) -> list[float]:
    """Each level's output tok/s over that of base's level of the same round (rounds base lacks left out)."""
    by_round = {lv.get("round", 0): lv["output_tok_s"] for lv in base}
    return [lv["output_tok_s"] / by_round[lv.get("round", 0)] for lv in lvs if by_round.get(lv.get("round", 0))]


def _brief(lvs: list[dict]) -> dict | None:
    """A mode's figures at one level: the median over its rounds (errors: their sum); None without a level."""
    if not lvs:
        return None
    each = [{k: lv[k] for k in ("output_tok_s", "request_s", "tau", "errors", "tokens_per_event")} | {
        "ttft_p50_ms": lv["ttft_ms"]["p50"], "itl_p50_ms": lv["itl_ms"]["p50"], "itl_p99_ms": lv["itl_ms"]["p99"],
        "tpot_p50_ms": lv["tpot_ms"]["p50"]} for lv in lvs]
    out = {}
    for k in each[0]:
        xs = [x[k] for x in each if x[k] is not None]
        out[k] = sum(xs) if k == "errors" else statistics.median(xs) if xs else None
    return out


def table(rs: list[dict]) -> str:
    def f(x, d=1):
        return "—" if x is None else f"{x:.{d}f}"

    variant = next((r["variant"] for r in rs if r.get("variant")), None)
    b = variant is not None
    modes = MODES[:2] + (variant,) * b

    def each(r, k, d=2):
        return " / ".join(f((r.get(m) or {}).get(k), d) for m in modes)

    def ratio(r, sp):
        """The median of the rounds' ratios sp (rows' speedup is that median) and their range."""
        if r.get("cut"):
            return "cut"
        sp = sp or []
        mid = statistics.median(sp) if sp else None
        return f(mid, 2) + "×" * (mid is not None) + (f" ({min(sp):.2f}–{max(sp):.2f})" if len(sp) > 1 else "")

    names = " / ".join(NAMES[m] for m in modes)
    vb = NAMES.get(variant, "")
    with_b = f"{vb} tok/s | {vb} ÷ AR | {vb} ÷ DSpark | " * b
    lines = ["| task | T | C | AR tok/s | DSpark tok/s | DSpark ÷ AR | " + with_b +
             "τ | TTFT p50 ms | ITL p50 ms | ITL p99 ms | TPOT p50 ms | errors | greedy = AR |",
             "|---|--:|--:|--:|--:|--:|" + "--:|--:|--:|" * b + "--:|--:|--:|--:|--:|--:|--:|"]
    for r in rs:
        ar, ds = r["ar"] or {}, r["dspark"] or {}
        greedy = "—" if r["greedy_compared"] is None else f"{r['greedy_equal']}/{r['greedy_compared']}"
        with_b = (f"{f((r.get(variant) or {}).get('output_tok_s'))} | {ratio(r, r.get('speedups_b'))} | "
                  f"{ratio(r, r.get('b_over_dspark'))} | " if b else "")
        lines.append(f"| {r['task']} | {r['temperature']:g} | {r['concurrency']} | {f(ar.get('output_tok_s'))} | "
                     f"{f(ds.get('output_tok_s'))} | {ratio(r, r.get('speedups'))} | {with_b}{f(ds.get('tau'), 2)} | "
                     f"{each(r, 'ttft_p50_ms')} | {each(r, 'itl_p50_ms')} | {each(r, 'itl_p99_ms')} | "
                     f"{each(r, 'tpot_p50_ms')} | "
                     f"{' / '.join(str((r.get(m) or {}).get('errors', '—')) for m in modes)} | {greedy} |")
    return "\n".join(lines) + f"\n\nFigures per cell: {names}. ITL is per SSE event (a DSpark event carries a " \
                              "whole verify step's tokens); TPOT is per token. cut: the time limit (--time-limit) " \
                              "ended a level, its errors the requests left unfinished. With --rounds R a figure is " \
                              "the median over the rounds, and the ratio's range over them follows it.\n"
