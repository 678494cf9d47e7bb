"""What a model costs: measured profiles of any nn.Module, and analytic profiles of reference models."""

from __future__ import annotations

from hetrain.workload.profile import BlockProfile, WorkloadProfile, profile
from hetrain.workload.zoo import get_profile, zoo_names

__all__ = ["BlockProfile", "WorkloadProfile", "get_profile", "profile", "zoo_names"]
