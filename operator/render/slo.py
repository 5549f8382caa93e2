"""Each service's SLO thresholds, carried to Prometheus as labels of its engines' series.

The operator writes `spec.slo` on the engine Service as labels (`specfleet.io/slo-ttft-seconds`,
`specfleet.io/slo-tpot-seconds`), and its ServiceMonitor copies them onto every scraped series as
`slo_ttft_seconds` and `slo_tpot_seconds`. The rules in deploy/monitoring/prometheus-rules.yaml pick, per
series, the histogram bucket whose `le` equals the label, so one static rule file alerts every service on
its own thresholds. A label is a bucket bound by construction: an SLO between two bounds is rounded down to
the lower one (the alert is stricter, never silent), since a threshold with no bucket would select nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specfleet.engine.server.metrics import LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS

from ..inference_service import InferenceService


@dataclass(frozen=True)
class SLOLabel:
    service_label: str  # on the Service (Kubernetes label key)
    series_label: str  # on every scraped series (Prometheus label name)
    buckets: Sequence[float]  # the bounds of the engine histogram the rules read


TTFT = SLOLabel("specfleet.io/slo-ttft-seconds", "slo_ttft_seconds", LATENCY_BUCKETS)
TPOT = SLOLabel("specfleet.io/slo-tpot-seconds", "slo_tpot_seconds", TOKEN_LATENCY_BUCKETS)


def bucket_bound(ms: int, buckets: Sequence[float]) -> str:
    """The largest bucket bound at or under `ms` milliseconds (the smallest bound if all are above), in
    seconds, written shortest: "0.5", "1" (the rules read a bucket `le` written "1.0" as "1")."""
    seconds = ms / 1000.0
    under = [b for b in buckets if b <= seconds + 1e-12]
    return f"{(max(under) if under else min(buckets)):g}"


def slo_service_labels(isvc: InferenceService) -> dict[str, str]:
    slo = isvc.spec.slo
    return {
        TTFT.service_label: bucket_bound(slo.ttft_p95_ms, TTFT.buckets),
        TPOT.service_label: bucket_bound(slo.tpot_p95_ms, TPOT.buckets),
    }


def slo_relabelings() -> list[dict[str, object]]:
    """ServiceMonitor relabelings: each Service label onto the series (the Prometheus Operator exposes a
    Service label `a.b/c-d` as `__meta_kubernetes_service_label_a_b_c_d`)."""

    def meta(key: str) -> str:
        return "__meta_kubernetes_service_label_" + "".join(c if c.isalnum() else "_" for c in key)

    return [
        {"sourceLabels": [meta(s.service_label)], "targetLabel": s.series_label, "action": "replace"}
        for s in (TTFT, TPOT)
    ]
