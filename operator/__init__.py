"""specfleet's Kubernetes operator: the InferenceService CRD model, pure renderers and kopf handlers.

Importing this package is cheap (pydantic only); kopf is imported by `handlers` and `cli`.
"""

from .inference_service import (
    InferenceService,
    InvalidInferenceService,
    load_inference_service,
    load_inference_services,
)
from .spec import InferenceServiceSpec

__all__ = [
    "InferenceService",
    "InferenceServiceSpec",
    "InvalidInferenceService",
    "load_inference_service",
    "load_inference_services",
]
