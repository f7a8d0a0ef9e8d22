"""What ``GET /metrics`` reports, in Prometheus' text exposition format (version 0.0.4), written by hand: requests by
route and status, prompt and completion tokens, tokens per verify forward (tau), queue depth, batched steps by mode
and batch size, and request latencies.

Counters are updated on the event loop (the handlers); the scheduler's figures are read when scraped.
"""

from __future__ import annotations

import math
from collections import Counter

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Upper bounds of the latency histograms' buckets, seconds (``+Inf`` added)."""


class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus' histogram."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S):
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{bound:g}"}} {n}' for bound, n in zip(self.bounds, self.counts,
                                                                                       strict=True)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        tail = f"{{{labels}}}" if labels else ""
        return [*out, f"{name}_sum{tail} {self.sum:.6g}", f"{name}_count{tail} {self.count}"]


class Metrics:
    """The server's counters (see module docstring)."""

    def __init__(self):
        self.requests: Counter[tuple[str, int]] = Counter()
        """``(route, HTTP status)`` -> requests answered."""
        self.prompt_tokens = self.completion_tokens = 0
        self.decode_tokens = self.decode_steps = 0
        """Tokens emitted by verify forwards, and those forwards, over finished requests: their ratio is tau."""
        self.latency: dict[str, Histogram] = {}
        """Route -> seconds from the request's arrival to its last byte (completions routes)."""
        self.first_token = Histogram()
        """Seconds to the first text of streamed requests."""

    def answered(self, route: str, status: int) -> None:
        self.requests[(route, status)] += 1

    def finished(self, route: str, stats, prompt_tokens: int, completion_tokens: int, seconds: float) -> None:
        """A completion request done (``stats``: its :class:`medusa.decode.loop.GenerationStats`)."""
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.decode_tokens += stats.decode_tokens
        self.decode_steps += stats.decode_steps
        self.latency.setdefault(route, Histogram()).observe(seconds)

    def text(self, scheduler, preparing: int) -> str:
        """The exposition: these counters and ``scheduler``'s (a :class:`medusa.serve.scheduler.Scheduler`)."""
        out = ["# HELP medusa_requests_total HTTP requests answered, by route and status.",
               "# TYPE medusa_requests_total counter"]
        out += [f'medusa_requests_total{{route="{route}",status="{status}"}} {n}'
                for (route, status), n in sorted(self.requests.items())]
        for name, value, what in (("prompt_tokens", self.prompt_tokens, "Prompt tokens of finished requests."),
                                  ("completion_tokens", self.completion_tokens, "Tokens generated."),
                                  ("decode_tokens", self.decode_tokens, "Tokens emitted by verify forwards."),
                                  ("decode_steps", self.decode_steps, "Verify forwards (decode steps).")):
            out += [f"# HELP medusa_{name}_total {what}", f"# TYPE medusa_{name}_total counter",
                    f"medusa_{name}_total {value}"]
        tau = self.decode_tokens / self.decode_steps if self.decode_steps else math.nan
        out += ["# HELP medusa_tau Tokens per verify forward over finished requests (decode_tokens / decode_steps).",
                "# TYPE medusa_tau gauge", f"medusa_tau {tau:.6g}" if not math.isnan(tau) else "medusa_tau NaN"]
        snapshot = scheduler.snapshot()
        out += ["# HELP medusa_queue_depth Requests by state.", "# TYPE medusa_queue_depth gauge",
                f'medusa_queue_depth{{state="running"}} {snapshot["running"]}',
                f'medusa_queue_depth{{state="waiting"}} {snapshot["waiting"]}',
                f'medusa_queue_depth{{state="preparing"}} {preparing}']
        out += ["# HELP medusa_batched_steps_total Batched decode steps, by batch size and mode.",
                "# TYPE medusa_batched_steps_total counter"]
        counts = dict(scheduler.choice.count)  # one C-level copy: the scheduler thread may add a size meanwhile
        out += [f'medusa_batched_steps_total{{batch_size="{b}",mode="{"plain" if plain else "speculative"}"}} {n}'
                for (b, plain), n in sorted(counts.items())]
        out += ["# HELP medusa_request_duration_seconds Completion requests, arrival to last byte.",
                "# TYPE medusa_request_duration_seconds histogram"]
        for route, histogram in sorted(self.latency.items()):
            out += histogram.lines("medusa_request_duration_seconds", f'route="{route}"')
        out += ["# HELP medusa_time_to_first_token_seconds Streamed requests, arrival to first text.",
                "# TYPE medusa_time_to_first_token_seconds histogram",
                *self.first_token.lines("medusa_time_to_first_token_seconds")]
        return "\n".join(out) + "\n"
