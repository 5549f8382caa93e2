"""Metadata every child object shares: deterministic names, labels and the controller owner reference."""

from __future__ import annotations

from typing import Any

from ..inference_service import InferenceService
from ..resources import API_VERSION, KIND, common_labels


def owner_reference(isvc: InferenceService) -> dict[str, Any]:
    """Makes the InferenceService the controller of a child: deleting it garbage-collects the child."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": isvc.name,
        "uid": isvc.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(isvc: InferenceService, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": isvc.namespace,
        "labels": common_labels(isvc.name),
        "ownerReferences": [owner_reference(isvc)],
    }
