"""The model-server protocol's metrics (Gateway API Inference Extension, docs/proposals/003): the vLLM names
a stock endpoint picker scrapes by default, served beside specfleet's own from the same step reports.

| protocol            | served as                                              |
| TotalQueuedRequests | `vllm:num_requests_waiting` (gauge)                    |
| TotalRunningRequests| `vllm:num_requests_running` (gauge)                    |
| KVCacheUtilization  | `vllm:kv_cache_usage_perc` (gauge, a fraction 0..1 as vLLM's), and the older   |
|                     | `vllm:gpu_cache_usage_perc` that EPPs before GIE v0.5 read                      |
| BlockSize, NumGPUBlocks | `vllm:cache_config_info{block_size, num_gpu_blocks}` (gauge, value 1)      |
| LoRA                | `vllm:lora_requests_info` (engine/server/lora_metrics.py, with --enable-lora)   |

Labels as vLLM's: `model_name` and `engine` (the data-parallel engine index; one engine per server here).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

ENGINE_INDEX = "0"  # vLLM labels each data-parallel engine; a specfleet server runs one


class ProtocolMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        label = ["model_name", "engine"]

        def gauge(name: str, doc: str) -> Gauge:
            g = Gauge(name, doc, label, registry=registry)
            g.labels(model_name, ENGINE_INDEX)  # every series exists from the first scrape
            return g

        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_kv_usage = gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage (older name)."
        )
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache config (value 1; the facts are the labels).",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"],
            registry=registry,
        )

    def set_cache_config(self, block_size: int, num_gpu_blocks: int, enable_prefix_caching: bool) -> None:
        self.cache_config.clear()
        self.cache_config.labels(
            str(block_size), str(num_gpu_blocks), str(enable_prefix_caching), ENGINE_INDEX
        ).set(1)

    def observe(self, running: int, waiting: int, kv_usage: float) -> None:
        m = self.model_name
        self.running.labels(m, ENGINE_INDEX).set(running)
        self.waiting.labels(m, ENGINE_INDEX).set(waiting)
        self.kv_usage.labels(m, ENGINE_INDEX).set(kv_usage)
        self.gpu_kv_usage.labels(m, ENGINE_INDEX).set(kv_usage)
