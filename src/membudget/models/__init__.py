"""The benchmark zoo: the models the DTR, Coop and OLLA papers report, built at any batch size
from ``transformers`` configs (random init, no downloads) or our own modules."""

from membudget.models.zoo import (
    ZOO,
    Workload,
    ZooModel,
    build,
    get,
    names,
    param_count,
    register,
)

__all__ = ["ZOO", "Workload", "ZooModel", "build", "get", "names", "param_count", "register"]
