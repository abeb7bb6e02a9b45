"""`/metrics` in Prometheus' text format (prometheus_client, one registry per app):
requests by route and status, tokens, draft proposals and acceptances (alpha is
their ratio), each request's decode speed and alpha, the queue, the prompt cache."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
__all__ = ["Metrics", "CONTENT_TYPE"]


class Metrics:
    def __init__(self, worker, prefix_cache=None):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("spel_http_requests", "HTTP requests answered, by route and status",
                                ("route", "status"), registry=r)
        self.jobs = Counter("spel_generations", "Generations by outcome (completed, cancelled, failed)",
                            ("outcome",), registry=r)
        self.prompt_tokens = Counter("spel_prompt_tokens", "Prompt tokens of generations run", registry=r)
        self.tokens = Counter("spel_generated_tokens", "Tokens generated", registry=r)
        self.proposed = Counter("spel_draft_proposed_tokens", "Draft proposals verified by the target", registry=r)
        self.accepted = Counter("spel_draft_accepted_tokens", "Draft proposals the target accepted", registry=r)
        self.alpha = Gauge("spel_alpha", "Acceptance rate (accepted / proposed) of all generations so far",
                           registry=r)
        self._drafted = [0, 0]      # proposed, accepted: alpha's own count
        self.tok_s = Histogram("spel_decode_tokens_per_second", "Decode speed of each generation (prefill excluded)",
                               buckets=(10, 25, 50, 100, 200, 300, 400, 600, 800, 1200, 1600), registry=r)
        self.last_tok_s = Gauge("spel_last_tokens_per_second", "Decode speed of the last generation", registry=r)
        Gauge("spel_queue_depth", "Requests waiting behind the running one", registry=r) \
            .set_function(lambda: worker.jobs.qsize())
        Gauge("spel_busy", "1 while a generation runs", registry=r).set_function(lambda: worker.current is not None)
        self.cache_hits = Counter("spel_prompt_cache_hits", "Generations that resumed from a saved prompt state",
                                  registry=r)
        self.cache_misses = Counter("spel_prompt_cache_misses", "Generations the prompt cache had no state for",
                                    registry=r)
        self.cached_tokens = Counter("spel_prompt_cache_tokens", "Prompt tokens restored instead of prefilled",
                                     registry=r)
        self.cache = prefix_cache
        if prefix_cache is not None:
            Gauge("spel_prompt_cache_entries", "Prompt states held", registry=r).set_function(lambda: len(prefix_cache))
            Gauge("spel_prompt_cache_bytes", "Bytes the held prompt states take", registry=r) \
                .set_function(lambda: prefix_cache.nbytes)

    def answered(self, path: str, status: int):
        self.requests.labels(path if path in ROUTES else "other", str(status)).inc()

    def finished(self, outcome: str, stats: dict | None):
        """A generation ended (called on the decoding thread)."""
        self.jobs.labels(outcome).inc()
        if not stats:
            return
        self.prompt_tokens.inc(stats.get("prompt_tokens", 0))
        if self.cache is not None:
            cached = stats.get("cached_tokens", 0)
            (self.cache_hits if cached else self.cache_misses).inc()
            self.cached_tokens.inc(cached)
        self.tokens.inc(stats.get("tokens", 0))
        self.proposed.inc(stats.get("proposed", 0))
        self.accepted.inc(stats.get("accepted", 0))
        self._drafted[0] += stats.get("proposed", 0)
        self._drafted[1] += stats.get("accepted", 0)
        if self._drafted[0]:
            self.alpha.set(self._drafted[1] / self._drafted[0])
        if stats.get("tokens") and stats.get("tok_s"):
            self.tok_s.observe(stats["tok_s"])
            self.last_tok_s.set(stats["tok_s"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
