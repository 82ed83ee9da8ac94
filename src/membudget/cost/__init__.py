"""Predicted aten op times on named devices (a roofline over FLOPs and bytes), for traces
recorded on the meta device or under FakeTensorMode."""

from membudget.cost.devices import DeviceSpec, cache_dir, cpu_spec, get_spec, known_specs
from membudget.cost.model import CostMode, CostModel, OpCost, op_plan, tensor_bytes

__all__ = ["CostMode", "CostModel", "DeviceSpec", "OpCost", "cache_dir", "cpu_spec", "get_spec",
           "known_specs", "op_plan", "tensor_bytes"]
