"""Prometheus metrics, named like vLLM's with an `llmc:` prefix. Engine state is read at scrape time."""
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmc.runtime.engine.engine_stats import EngineStats, SpeculativeStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        yield GaugeMetricFamily("llmc:num_requests_running", "Requests in the running batch.", value=stats.num_running)
        yield GaugeMetricFamily("llmc:num_requests_waiting", "Requests waiting for KV blocks.", value=stats.num_waiting)
        yield GaugeMetricFamily("llmc:kv_cache_usage_perc", "Fraction of KV blocks in use.", value=stats.num_used_blocks / stats.num_blocks)
        queries, hits = stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens
        yield CounterMetricFamily("llmc:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", value=queries)
        yield CounterMetricFamily("llmc:prefix_cache_hits", "Prompt tokens found in the prefix cache.", value=hits)
        hit_rate = hits / queries if queries else 0.0
        yield GaugeMetricFamily("llmc:prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens.", value=hit_rate)
        yield CounterMetricFamily("llmc:num_preemptions", "Sequences preempted for lack of KV blocks.", value=stats.num_preemptions)
        finished = CounterMetricFamily("llmc:request_success", "Finished requests.", labels=["finished_reason"])
        for reason in ("stop", "length", "abort"):
            finished.add_metric([reason], (stats.num_finished or {}).get(reason, 0))
        yield finished
        if stats.speculative is not None:
            yield from self.collect_speculative(stats.speculative)

    def collect_speculative(self, stats: SpeculativeStats):
        yield CounterMetricFamily("llmc:spec_decode_num_drafts", "Verification steps with draft tokens.", value=stats.num_drafts)
        yield CounterMetricFamily("llmc:spec_decode_num_draft_tokens", "Draft tokens proposed.", value=stats.num_draft_tokens)
        yield CounterMetricFamily("llmc:spec_decode_num_accepted_tokens", "Draft tokens accepted.", value=stats.num_accepted_tokens)
        per_position = CounterMetricFamily("llmc:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
                                           labels=["position"])
        for position, accepted in enumerate(stats.accepted_per_position):
            per_position.add_metric([str(position)], accepted)
        yield per_position
        yield GaugeMetricFamily("llmc:spec_decode_mean_accepted_length", "Tokens emitted per verification step (1 + accepted / drafts).",
                                value=stats.mean_accepted_length)


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats))
        self.time_to_first_token = Histogram(
            "llmc:time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.inter_token_latency = Histogram(
            "llmc:inter_token_latency_seconds", "Time between two output tokens.", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.e2e_latency = Histogram(
            "llmc:e2e_request_latency_seconds", "Request latency.", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.prompt_tokens = Counter("llmc:prompt_tokens", "Prompt tokens processed.", registry=self.registry)
        self.generation_tokens = Counter("llmc:generation_tokens", "Tokens generated.", registry=self.registry)
