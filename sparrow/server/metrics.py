"""The server's Prometheus metrics: vLLM's metric names with a ``sparrow:`` prefix (prometheus-client renders
the text format; counters get their ``_total`` suffix from it).

One ``ServerMetrics`` per server, in its own CollectorRegistry (two servers in one process do not collide), in
the front end's process. Gauges and the engine's own counts (preemptions, prefix cache, speculative decoding)
come from the ``EngineState`` of each engine message (``observe_state``); the latency histograms and token
counters are fed by the ``EngineClient`` as the engine's outputs arrive.

With LoRA on, vLLM's ``lora_requests_info`` gauge: its labels carry the state (``running_lora_adapters`` /
``waiting_lora_adapters``: the adapter names of the running / waiting sequences, comma-separated, each once, in queue
order; ``max_lora``: the most adapters in one step), its value the wall-clock time (Unix seconds) they were last set:
with each engine message, as vLLM sets it every iteration. vLLM keeps every label set it has shown, so its readers
take the series with the newest value; here the previous series is dropped when the labels change, so the one series
shown is that newest one.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
"""Seconds (vLLM's time_to_first_token buckets, extended to long CPU requests)."""


class ServerMetrics:
    """``spec_k``: the speculative decoding draft length (None: speculation off, no spec_decode counters);
    ``max_loras``: LoRAConfig.max_loras (None: LoRA off, no lora_requests_info)."""

    def __init__(self, model_name: str, spec_k: int | None = None, max_loras: int | None = None):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        self.state = None

        def gauge(name, doc, fn):
            g = Gauge(f"sparrow:{name}", doc, list(labels), registry=r)
            g.labels(**labels).set_function(fn)

        gauge("num_requests_running", "Sequences in the running batch.",
              lambda: self.state.running if self.state else 0)
        gauge("num_requests_waiting", "Sequences waiting to be scheduled.",
              lambda: self.state.waiting if self.state else 0)
        gauge("kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.",
              lambda: self.state.kv_cache_usage if self.state else 0.0)

        def counter(name, doc):
            return Counter(f"sparrow:{name}", doc, list(labels), registry=r).labels(**labels)

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (blocks freed, recomputed later).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.request_success = Counter("sparrow:request_success", "Finished requests by finish reason.",
                                       [*labels, "finished_reason"], registry=r)
        self._labels = labels

        def hist(name, doc):
            return Histogram(f"sparrow:{name}", doc, list(labels), buckets=_LATENCY_BUCKETS,
                             registry=r).labels(**labels)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to the first generated token.")
        self.itl = hist("inter_token_latency_seconds", "Time between two outputs of a request, per token.")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the last token.")
        self.queue_time = hist("request_queue_time_seconds", "Arrival to the engine loop taking the request in.")
        steps = Histogram("sparrow:engine_step_seconds", "Wall time of an engine step, by kind: prefill (it "
                          "computed prompt tokens, alone or beside decode rows) or decode.", [*labels, "kind"],
                          buckets=_LATENCY_BUCKETS, registry=r)
        self.step_seconds = {kind: steps.labels(**labels, kind=kind) for kind in ("prefill", "decode")}
        self._seen = (0, 0, 0)
        self._spec_seen: tuple[int, ...] = ()
        if spec_k is not None:  # vLLM's spec_decode counters, only when speculation is on
            self.spec_counters = (counter("spec_decode_num_drafts", "Verify steps of a sequence with drafts."),
                                  counter("spec_decode_num_draft_tokens", "Draft tokens verified."),
                                  counter("spec_decode_num_accepted_tokens", "Draft tokens accepted."))
            per_pos = Counter("sparrow:spec_decode_num_accepted_tokens_per_pos",
                              "Draft tokens accepted, by position in the draft (0-based).", [*labels, "position"],
                              registry=r)
            self.spec_per_pos = [per_pos.labels(**labels, position=str(i)) for i in range(spec_k)]
            self._spec_seen = (0,) * (3 + spec_k)
        self.lora_info = None
        self._lora_labels: tuple[str, str] | None = None  # (running, waiting) of the series shown
        self._max_lora = str(max_loras)
        if max_loras is not None:
            self.lora_info = Gauge("sparrow:lora_requests_info", "LoRA adapters of the running and waiting requests "
                                   "(labels); the value is when they were last set (Unix seconds).",
                                   ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r)
            self._show_lora(("", ""))  # shown from the start (max_lora), as the engine's states come later

    def finished(self, reason: str) -> None:
        self.request_success.labels(**self._labels, finished_reason=reason).inc()

    def set_baseline(self, state) -> None:
        """Count the engine's cumulative counts from ``state`` on (what ran before the server started, such as
        its warm-up, is not counted)."""
        self.state = state
        self._seen = (state.num_preemptions, state.prefix_cache_queries, state.prefix_cache_hits)
        if state.spec is not None and self._spec_seen:
            self._spec_seen = state.spec
        self._set_lora(state)

    def observe_state(self, state) -> None:
        """Take an ``EngineState``: the gauges show it; the counters carried over from the engine's cumulative
        counts (preemptions, prefix-cache lookups, speculative decoding's) advance by what is new."""
        self.state = state
        if state.step is not None:
            self.step_seconds[state.step[0]].observe(state.step[1])
        now = (state.num_preemptions, state.prefix_cache_queries, state.prefix_cache_hits)
        for counter, new, old in zip((self.num_preemptions, self.prefix_cache_queries, self.prefix_cache_hits),
                                     now, self._seen):
            if new > old:
                counter.inc(new - old)
        self._seen = now
        if state.spec is not None and self._spec_seen:
            for counter, new, old in zip((*self.spec_counters, *self.spec_per_pos), state.spec, self._spec_seen):
                if new > old:
                    counter.inc(new - old)
            self._spec_seen = state.spec
        self._set_lora(state)

    def _set_lora(self, state) -> None:
        if self.lora_info is not None and state.lora is not None:
            self._show_lora((",".join(state.lora[0]), ",".join(state.lora[1])))

    def _show_lora(self, labels: tuple[str, str]) -> None:
        """lora_requests_info's series of (running, waiting) ``labels`` set to now, the previous one dropped."""
        if self._lora_labels is not None and labels != self._lora_labels:
            self.lora_info.remove(*self._lora_labels, self._max_lora)
        self._lora_labels = labels
        self.lora_info.labels(*labels, self._max_lora).set_to_current_time()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
