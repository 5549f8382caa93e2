"""How pods are replaced on a spec change: the Deployment's strategy, and its defaults for GPU and CPU pods."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from .fields import IntOrPercent, IntOrPercentTo100, _Spec, cel

GPU_SAFE_ROLLOUT = (
    "RollingUpdate",
    "0",
    "1",
)  # no surge pod: it would wait Pending for a GPU the old pod holds
CPU_ROLLOUT = ("RollingUpdate", "1", "0")  # surge one pod, never below the ready count


class RolloutSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.strategy) || self.strategy != 'Recreate' || (!has(self.maxSurge) && "
                    "!has(self.maxUnavailable))",
                    "rollout.maxSurge and maxUnavailable apply to RollingUpdate only",
                ),
                cel(
                    "!has(self.maxSurge) || !has(self.maxUnavailable) || !(string(self.maxSurge) in ['0', '0%'] && "
                    "string(self.maxUnavailable) in ['0', '0%'])",
                    "rollout.maxSurge and maxUnavailable cannot both be 0 (no pod could ever be replaced)",
                ),
            ]
        }
    )
    strategy: Literal["RollingUpdate", "Recreate"] | None = Field(
        None,
        description="How pods are replaced on a spec change. Unset: RollingUpdate with maxSurge 0 and "
        "maxUnavailable 1 when resources.gpus > 0 (no surge pod waiting for a GPU on a full pool), else maxSurge 1 "
        "and maxUnavailable 0.",
    )
    max_surge: IntOrPercent | None = Field(None, description="Pods above replicas during a RollingUpdate.")
    max_unavailable: IntOrPercentTo100 | None = Field(
        None, description="Pods below replicas during a RollingUpdate."
    )

    @model_validator(mode="after")
    def _consistent(self) -> RolloutSpec:
        if self.strategy == "Recreate" and (self.max_surge is not None or self.max_unavailable is not None):
            raise ValueError("rollout.maxSurge and maxUnavailable apply to RollingUpdate only, not Recreate")
        if self.max_surge in ("0", "0%") and self.max_unavailable in ("0", "0%"):
            raise ValueError(
                "rollout.maxSurge and maxUnavailable cannot both be 0 (no pod could ever be replaced)"
            )
        return self

    def resolved(self, gpus: int) -> tuple[str, str | None, str | None]:
        """(strategy, maxSurge, maxUnavailable) in force: unset fields take the default for GPU or CPU pods,
        except that a default never makes both 0 next to a 0 the user set."""
        if self.strategy == "Recreate":
            return "Recreate", None, None
        _, surge, unavailable = GPU_SAFE_ROLLOUT if gpus > 0 else CPU_ROLLOUT
        zero = ("0", "0%")
        if self.max_surge is not None:
            surge = self.max_surge
            unavailable = self.max_unavailable or ("1" if surge in zero else unavailable)
        elif self.max_unavailable is not None:
            unavailable = self.max_unavailable
            surge = "1" if unavailable in zero else surge
        return "RollingUpdate", surge, unavailable
