"""The InferenceService spec as pydantic models: the one source of truth for the CRD's spec schema.

`crds/inferenceservice.yaml` is generated from these classes (`python -m specfleet.operator.generate`), so a
field, default, enum, bound or CEL rule is written once, here. Cross-field rules are written twice on
purpose, side by side: as a CEL expression the API server enforces (`x-kubernetes-validations`) and as the
equivalent Python check pydantic runs for `specfleet up` (no API server there); the tests evaluate both on
the same table of invalid inputs.

One module per section of the spec, each importable from here:

- `fields.py`: the base model, CEL rules, quantities, int-or-string and upstream Kubernetes fields
- `model.py`: `model` and the draft model's source (`ModelSource`, `ModelSpec`, `DraftModelSpec`)
- `engine.py`: `engine` and `batching`
- `speculative.py`: `speculative`
- `placement.py`: `resources` and `scheduling`
- `rollout.py`: `rollout`
- `pod.py`: `pod`, kept off the operator's own env, volumes and mount paths
- `disaggregation.py`: `disaggregation` (prefill/decode roles)
- `autotune.py`: `slo` and `autotune` (bounds and pins generated from the knob declaration)
- `routing.py`: `routing`, with the router pods' placement
- `autoscaling.py`: `autoscaling`
- `observability.py`: `observability` (where request traces go)
- `adapters.py`: `adapters` and `lora` (LoRA adapters on the model)
- `service.py`: `InferenceServiceSpec`, the rules that span sections
"""

from .adapters import (
    ADAPTER_SOURCE_PATTERN,
    AdapterSpec,
    LoraSpec,
)
from .autoscaling import (
    AutoscalingSpec,
)
from .autotune import (
    FREEZE_ANNOTATION,
    AutotuneBounds,
    AutotunePins,
    AutotuneSpec,
    SLOSpec,
    knob_limits,
)
from .disaggregation import (
    DisaggregationRole,
    DisaggregationSpec,
)
from .engine import (
    NODES_SPLIT,
    BatchingSpec,
    EngineSpec,
)
from .fields import (
    INT_OR_PERCENT_PATTERN,
    INT_OR_PERCENT_TO_100_PATTERN,
    K8S_SCHEMA_KEY,
    POSITIVE_QUANTITY_PATTERN,
    QUANTITY_PATTERN,
    IntOrPercent,
    IntOrPercentTo100,
    OptionalName,
    PositiveQuantity,
    Quantity,
    cel,
    upstream,
)
from .model import (
    HF_PARENT_MESSAGE,
    HF_PARENT_SEGMENT,
    SOURCE_PATTERN,
    DraftModelSpec,
    ModelCacheSpec,
    ModelSource,
    ModelSpec,
)
from .observability import (
    OTLP_ENDPOINT_PATTERN,
    ObservabilitySpec,
)
from .placement import (
    NODE_SELECTOR_KEYS,
    LabelValue,
    ResourcesSpec,
    SchedulingSpec,
)
from .pod import (
    RESERVED_ENV,
    RESERVED_MOUNT_PATHS,
    RESERVED_VOLUME_PREFIXES,
    RESERVED_VOLUMES,
    PodTemplateSpec,
)
from .rollout import (
    CPU_ROLLOUT,
    GPU_SAFE_ROLLOUT,
    RolloutSpec,
)
from .routing import (
    ALIASES_UNIQUE,
    MODEL_NAME_MAX,
    MODEL_NAME_PATTERN,
    ROUTER_POD_FIELDS,
    RouterPodSpec,
    RoutingSpec,
)
from .service import (
    DISAGGREGATION_REPLICAS,
    DISAGGREGATION_ROUTING,
    DISAGGREGATION_SPLIT,
    GPUS_PER_SPLIT,
    QUANTIZED_SPLIT,
    SCALE_TO_ZERO,
    InferenceServiceSpec,
)
from .speculative import (
    SpeculativeSpec,
)

__all__ = [
    "ADAPTER_SOURCE_PATTERN",
    "AdapterSpec",
    "LoraSpec",
    "ALIASES_UNIQUE",
    "AutoscalingSpec",
    "AutotuneBounds",
    "AutotunePins",
    "AutotuneSpec",
    "BatchingSpec",
    "CPU_ROLLOUT",
    "DISAGGREGATION_REPLICAS",
    "DISAGGREGATION_ROUTING",
    "DISAGGREGATION_SPLIT",
    "DisaggregationRole",
    "DisaggregationSpec",
    "DraftModelSpec",
    "EngineSpec",
    "FREEZE_ANNOTATION",
    "GPUS_PER_SPLIT",
    "GPU_SAFE_ROLLOUT",
    "HF_PARENT_MESSAGE",
    "HF_PARENT_SEGMENT",
    "INT_OR_PERCENT_PATTERN",
    "INT_OR_PERCENT_TO_100_PATTERN",
    "InferenceServiceSpec",
    "IntOrPercent",
    "IntOrPercentTo100",
    "K8S_SCHEMA_KEY",
    "LabelValue",
    "MODEL_NAME_MAX",
    "MODEL_NAME_PATTERN",
    "ModelCacheSpec",
    "ModelSource",
    "ModelSpec",
    "NODES_SPLIT",
    "NODE_SELECTOR_KEYS",
    "OTLP_ENDPOINT_PATTERN",
    "ObservabilitySpec",
    "OptionalName",
    "POSITIVE_QUANTITY_PATTERN",
    "PodTemplateSpec",
    "PositiveQuantity",
    "QUANTITY_PATTERN",
    "QUANTIZED_SPLIT",
    "Quantity",
    "RESERVED_ENV",
    "RESERVED_MOUNT_PATHS",
    "RESERVED_VOLUMES",
    "RESERVED_VOLUME_PREFIXES",
    "ROUTER_POD_FIELDS",
    "ResourcesSpec",
    "RolloutSpec",
    "RouterPodSpec",
    "RoutingSpec",
    "SCALE_TO_ZERO",
    "SLOSpec",
    "SOURCE_PATTERN",
    "SchedulingSpec",
    "SpeculativeSpec",
    "cel",
    "knob_limits",
    "upstream",
]
