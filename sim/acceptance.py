"""Classes of acceptance from an engine's /metrics: what `specfleet simulate --acceptance-from` and bench sim
read into a profile's `acceptance_classes` (sim/profile.py `AcceptanceClass`).

The engine counts each finished request that decoded in one class, by the share of its draft tokens
accepted (engine/spec_decode/request_classes.py), on counters labelled `class`; the texts of several engines
(or scrapes saved to files) are summed.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families
from specfleet.engine.spec_decode.request_classes import COUNTED, METRIC_PREFIX

from .profile import AcceptanceClass, acceptance_classes


def classes_from_metrics(
    texts: Iterable[str], k: int, since: Iterable[str] = ()
) -> tuple[AcceptanceClass, ...]:
    """The classes of the engines whose Prometheus texts are `texts` (less what their texts `since`, an
    earlier scrape, had counted: a trace's requests alone), drafted at most `k` tokens: () where no request
    finished into a class (speculation off, or an engine from before the counters)."""
    totals, per_pos = _counts(texts)
    before, before_pos = _counts(since)
    rows = []
    for cls in sorted(totals):
        row, pos = totals[cls], per_pos.get(cls, {})
        was, was_pos = before.get(cls, dict.fromkeys(COUNTED, 0.0)), before_pos.get(cls, {})
        accepted = [pos.get(i, 0.0) - was_pos.get(i, 0.0) for i in range(max(pos) + 1)] if pos else []
        counted = [row[c] - was[c] for c in COUNTED]
        rows.append((counted[0], counted[1], counted[2], counted[3], accepted))
    return acceptance_classes(rows, k)


def _counts(texts: Iterable[str]) -> tuple[dict[int, dict[str, float]], dict[int, dict[int, float]]]:
    """Per class, the `COUNTED` counters and the accepted tokens per position, summed over the texts."""
    position = METRIC_PREFIX + "accepted_tokens_per_pos_total"
    totals: dict[int, dict[str, float]] = {}
    per_pos: dict[int, dict[int, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, labels = sample.name, sample.labels
                if name == position:
                    pos = per_pos.setdefault(int(labels["class"]), {})
                    at = int(labels["position"])
                    pos[at] = pos.get(at, 0.0) + sample.value
                elif name.startswith(METRIC_PREFIX) and name.endswith("_total"):
                    counted = name[len(METRIC_PREFIX) : -len("_total")]
                    if counted in COUNTED:
                        row = totals.setdefault(int(labels["class"]), dict.fromkeys(COUNTED, 0.0))
                        row[counted] += sample.value
    return totals, per_pos
