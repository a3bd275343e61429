"""GET /metrics: the engine's counters as Prometheus text, vLLM's names (spec decoding, tokens, time to first token,
requests) beside ours (dspark:, per k the steps and their times, the engine thread's time, the k policy's view)."""
from __future__ import annotations

from dspark.policy import EARLY_STEPS, REPICK_EVERY
from serve.runner import Snapshot


def metrics_text(s: Snapshot, model: str) -> str:
    """The engine's snapshot as Prometheus text."""
    c = s.counters
    lab = f'engine="0",model_name="{model}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}}} {float(v)}" for labels, v in samples)

    metric("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.",
           [(lab, c["num_drafts"])])
    metric("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.",
           [(lab, c["num_draft_tokens"])])
    metric("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.",
           [(lab, c["num_accepted_tokens"])])
    metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted tokens per draft position.",
           [(f'{lab},position="{i}"', v) for i, v in enumerate(c["num_accepted_tokens_per_pos"])])
    metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", [(lab, c["prompt_tokens"])])
    metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
           [(lab, c["generation_tokens"])])
    metric("dspark:decode_steps_total", "counter", "Decode steps by the drafts per row the engine chose (k).",
           [(f'{lab},k="{k}"', v) for k, v in enumerate(c["decode_steps_per_k"])])
    metric("dspark:overlapped_steps_total", "counter", "Decode steps queued while the one before was in flight "
           "(async scheduling).", [(lab, c.get("overlapped_steps", 0))])
    metric("dspark:context_flushes_total", "counter", "Flushes of stashed drafter context before drafting after "
           "plain steps.", [(lab, c.get("context_flushes", 0))])
    metric("dspark:context_flushes_queued_total", "counter", "Of those, flushes queued behind a plain step in "
           "flight.", [(lab, c.get("context_flushes_queued", 0))])
    metric("dspark:context_flush_seconds_total", "counter", "The flushes' host seconds.",
           [(lab, c.get("context_flush_s", 0.0))])
    metric("dspark:step_host_ms", "gauge", "The host's own work per decode step, its waits for the device left out "
           "(median over the last steps).", [(lab, c.get("host_ms", 0.0))])
    for key, name, help_ in [
            ("loop_s", "dspark:engine_loop_seconds_total",
             "The engine thread's busy time: steps and delivery."),
            ("step_s", "dspark:engine_step_seconds_total", "Time inside the engine's step(), its waits included."),
            ("read_wait_s", "dspark:step_read_wait_seconds_total", "Time the host waited for decode steps' results."),
            ("launch_wait_s", "dspark:step_launch_wait_seconds_total", "Time the host waited before refilling a "
             "step's inputs (the copy out of them had not run).")]:
        metric(name, "counter", help_, [(lab, c.get(key, 0.0))])
    for key, name, kind, help_ in [
            ("device_steps_per_k", "dspark:step_device_timed_total", "counter",
             "Graph decode steps timed on the device (events around every 8th replay), by k."),
            ("device_ms_per_k", "dspark:step_device_ms_total", "counter",
             "Their replays' time on the device (ms), by k."),
            ("step_cycles_per_k", "dspark:step_cycles_total", "counter",
             "Back-to-back graph decode steps timed, by the drafts per row (k)."),
            ("step_cycle_ms_per_k", "dspark:step_cycle_ms_total", "counter",
             "Their time from one step's start to the next (ms), by k."),
            ("step_replay_ms_per_k", "dspark:step_replay_ms_total", "counter",
             "Their graphs' replay time as measured at capture (ms), by k."),
            ("step_switches_per_k", "dspark:step_switches_total", "counter",
             "Graph decode steps that began a run of their kind after a step of another (left out of the cycles "
             "above), by k."),
            ("step_switch_ms_per_k", "dspark:step_switch_ms_total", "counter",
             "Their time from one step's start to the next (ms), by k."),
            ("step_early_cycles_per_k", "dspark:step_early_cycles_total", "counter",
             f"Of the back-to-back steps timed, those among the first {EARLY_STEPS} timed steps of a run of their "
             "kind, by k."),
            ("step_early_cycle_ms_per_k", "dspark:step_early_cycle_ms_total", "counter",
             "Their time from one step's start to the next (ms), by k.")]:
        metric(name, kind, help_, [(f'{lab},k="{k}"', v) for k, v in enumerate(c.get(key, []))])
    policy = c.get("policy")
    if policy is not None:  # a server with a drafter: what its k policy weighs now
        metric("dspark:policy_step_cost_ms", "gauge", "The k policy's cost of a kind of decode step: the median of its "
               "last back-to-back cycles (ms), by batch bucket, drafts per row and sampling mode.",
               [(f'{lab},rows="{r}",k="{k}",mode="{m}"', ms) for r, k, m, ms in policy["step_cost_ms"]])
        metric("dspark:policy_acceptance", "gauge", "The k policy's acceptance estimate per draft position (given "
               "all before it accepted; recent row-steps), greedy and sampled rows apart.",
               [(f'{lab},group="{g}",position="{j}"', a) for g, al in policy["acceptance"].items()
                for j, a in enumerate(al)])
        metric("dspark:policy_flush_ms", "gauge", "The k policy's estimate of a context flush's host time (ms).",
               [(lab, policy["flush_ms"])])
        metric("dspark:policy_choices_total", "counter", f"The k policy's choices (each reused for up to "
               f"{REPICK_EVERY} steps), by batch size, drafts per row, sampling mode and basis: the chosen kind's "
               "cost measured or modelled, or a probe of the whole block for the acceptance statistics.",
               [(f'{lab},rows="{r}",k="{k}",mode="{m}",basis="{b}"', n) for r, k, m, b, n in policy["choices"]])
        metric("dspark:policy_draft_weighed_total", "counter", "Over the k policy's choices to draft (probes left "
               "out), by k: how many (what=n), and the sums of what each weighed: plain decoding's cost (plain_ms) and "
               "the chosen k's (ms), the chosen k's expected tokens per row (expected); and of the plain cost's basis: "
               "its kind's cycles (plain_cycles), the least of them (plain_min_ms), its age in decode steps "
               "(plain_age).",
               [(f'{lab},k="{e["k"]}",what="{w}"', v) for e in policy["weighed"] for w, v in e.items() if w != "k"])
    n, queue, prefill = c.get("first_tokens", 0), c.get("queue_s", 0.0), c.get("prefill_s", 0.0)
    for total, name, help_ in [(queue + prefill, "vllm:time_to_first_token_seconds", "Time to first token: added to "
                                "the engine -> first token sampled."),
                               (queue, "vllm:request_queue_time_seconds", "Time a request waited for admission."),
                               (prefill, "vllm:request_prefill_time_seconds", "Admission -> first token.")]:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", f'{name}_bucket{{{lab},le="+Inf"}} {float(n)}',
                  f"{name}_sum{{{lab}}} {float(total)}", f"{name}_count{{{lab}}} {float(n)}"]
    for prefix in ("vllm", "dspark"):
        metric(f"{prefix}:num_requests_running", "gauge", "Requests in the running batch.", [(lab, s.running)])
        metric(f"{prefix}:num_requests_waiting", "gauge", "Requests waiting for admission.", [(lab, s.waiting)])
    metric("dspark:cache_blocks_used", "gauge", "KV cache blocks in use.", [(lab, s.blocks_used)])
    metric("dspark:cache_blocks_free", "gauge", "KV cache blocks free.", [(lab, s.blocks_free)])
    return "\n".join(lines) + "\n"
