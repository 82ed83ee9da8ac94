"""Named devices for the cost model: peak FLOP/s per dtype, memory bandwidth, launch overhead.

The GPU numbers are the vendors' published peaks (dense, no sparsity); ``flops_efficiency`` and
``bandwidth_efficiency`` scale them to what cuBLAS/cuDNN and copy kernels reach on large shapes.
The ``cpu`` spec is measured on this machine at first use and cached on disk, unless
``$MEMBUDGET_CPU_SPEC`` names a file of one to use instead.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

import torch
from torch.utils._python_dispatch import _disable_current_modes

from membudget.errors import MembudgetError, UnknownNameError

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """A device's roofline. FLOP/s are of its matmul units (tensor cores where it has them),
    since only matmuls, convolutions and attention are timed by FLOPs; everything else is
    timed by bytes. ``bf16_flops``/``tf32_flops`` are None where the device has no such units
    (bf16 then runs at the fp32 rate; fp32 is never rounded to TF32)."""

    name: str
    fp32_flops: float
    fp16_flops: float
    bf16_flops: float | None
    tf32_flops: float | None
    fp64_flops: float
    bandwidth: float  # bytes/s
    launch_overhead: float  # seconds added to every op that runs a kernel
    flops_efficiency: float = 1.0  # achieved / peak FLOP/s on large matmuls and convolutions
    bandwidth_efficiency: float = 1.0  # achieved / peak bytes/s of a large elementwise kernel
    source: str = ""
    # the link to host memory that a swap crosses, rated bytes/s each way (0: none, a "swap"
    # is then a copy within the device's own memory, as on a CPU)
    host_link: str = ""
    host_bandwidth: float = 0.0
    # elements/s of the elementwise ops whose arithmetic, not their bytes, bounds them (aten
    # op name -> rate; measured on a CPU, where one core computes tanh at a tenth of the rate
    # it streams memory; empty for the GPUs, where such ops are bound by their bytes)
    math_rates: dict[str, float] = field(default_factory=dict)

    def host_link_rate(self) -> float:
        """Achieved bytes/s of a copy to or from host memory (pinned, one direction); with
        no host link, of a copy within its own memory (bytes read and written)."""
        if self.host_bandwidth:
            return self.host_bandwidth * HOST_LINK_EFF
        return self.bandwidth * self.bandwidth_efficiency / 2

    def move_ns(self) -> tuple[float, float]:
        """A move's price in ns (a copy within device memory, its bytes read and written):
        per byte each way, and per copy (the launch overhead)."""
        return 1e9 / (self.bandwidth * self.bandwidth_efficiency), self.launch_overhead * 1e9

    def host_copy_ns(self) -> tuple[float, float]:
        """A host copy's price in ns: per byte, and per copy (the launch overhead)."""
        return 1e9 / self.host_link_rate(), self.launch_overhead * 1e9

    def peak_flops(self, dtype: torch.dtype, *, tf32: bool = False) -> float:
        """Peak matmul FLOP/s for ``dtype`` (fp32 at the TF32 rate when ``tf32`` and the device
        has TF32); dtypes without their own entry (integers, fp8, complex) use the fp32 rate."""
        if dtype == torch.float32:
            return self.tf32_flops if tf32 and self.tf32_flops else self.fp32_flops
        if dtype == torch.float16:
            return self.fp16_flops
        if dtype == torch.bfloat16:
            return self.bf16_flops or self.fp32_flops
        if dtype == torch.float64:
            return self.fp64_flops
        return self.fp32_flops


# GPU launch overhead: the stream time of a tiny kernel issued from PyTorch eager (CPU-side
# dispatch plus launch latency, about 4-10 µs); large kernels hide it entirely.
GPU_LAUNCH = 5e-6
# cuBLAS SGEMM / tensor-core GEMM and cuDNN convolutions reach roughly 75-95 % of the rated
# peak on large shapes; copy and elementwise kernels roughly 80-90 % of the rated bandwidth
# (BabelStream-style measurements). One factor each for all GPUs keeps the model simple.
GPU_FLOPS_EFF = 0.85
GPU_BW_EFF = 0.85
# pinned cudaMemcpy over PCIe reaches about 80 % of the link's rated bandwidth (e.g. 25 of
# 31.5 GB/s on PCIe 4.0 x16 in bandwidthTest), the packet and protocol overhead
HOST_LINK_EFF = 0.8
PCIE3 = ("PCIe 3.0 x16", 15.75 * GIGA)  # rated bytes/s each way: 8 GT/s × 16 lanes, 128b/130b
PCIE4 = ("PCIe 4.0 x16", 31.5 * GIGA)
PCIE5 = ("PCIe 5.0 x16", 63.0 * GIGA)

GPU_SPECS: dict[str, DeviceSpec] = {
    spec.name: spec for spec in (
        DeviceSpec(
            "a100-80gb", fp32_flops=19.5 * TERA, tf32_flops=156 * TERA, fp16_flops=312 * TERA,
            bf16_flops=312 * TERA, fp64_flops=19.5 * TERA, bandwidth=2039 * GIGA,
            launch_overhead=GPU_LAUNCH, flops_efficiency=GPU_FLOPS_EFF,
            bandwidth_efficiency=GPU_BW_EFF, host_link=PCIE4[0], host_bandwidth=PCIE4[1],
            source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): FP32 19.5 TF, TF32 "
                   "156 TF, FP16/BF16 312 TF (dense), FP64 tensor core 19.5 TF, HBM2e 2,039 GB/s"),
        DeviceSpec(
            "a100-40gb", fp32_flops=19.5 * TERA, tf32_flops=156 * TERA, fp16_flops=312 * TERA,
            bf16_flops=312 * TERA, fp64_flops=19.5 * TERA, bandwidth=1555 * GIGA,
            launch_overhead=GPU_LAUNCH, flops_efficiency=GPU_FLOPS_EFF,
            bandwidth_efficiency=GPU_BW_EFF, host_link=PCIE4[0], host_bandwidth=PCIE4[1],
            source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB): as the 80GB part, "
                   "HBM2 1,555 GB/s"),
        DeviceSpec(
            "h100", fp32_flops=67 * TERA, tf32_flops=494.5 * TERA, fp16_flops=989.5 * TERA,
            bf16_flops=989.5 * TERA, fp64_flops=67 * TERA, bandwidth=3350 * GIGA,
            launch_overhead=GPU_LAUNCH, flops_efficiency=GPU_FLOPS_EFF,
            bandwidth_efficiency=GPU_BW_EFF, host_link=PCIE5[0], host_bandwidth=PCIE5[1],
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP32 67 TF, TF32 989 TF and "
                   "FP16/BF16 1,979 TF with sparsity (halved: dense), FP64 tensor core 67 TF, "
                   "HBM3 3.35 TB/s"),
        DeviceSpec(
            "rtx-2080ti", fp32_flops=13.45 * TERA, tf32_flops=None, fp16_flops=53.8 * TERA,
            bf16_flops=None, fp64_flops=0.42 * TERA, bandwidth=616 * GIGA,
            launch_overhead=GPU_LAUNCH, flops_efficiency=GPU_FLOPS_EFF,
            bandwidth_efficiency=GPU_BW_EFF, host_link=PCIE3[0], host_bandwidth=PCIE3[1],
            source="NVIDIA Turing architecture whitepaper, GeForce RTX 2080 Ti reference "
                   "(1,545 MHz boost): FP32 13.4 TF, FP16 tensor 53.8 TF with FP32 accumulate "
                   "(PyTorch's default; 107.6 TF with FP16 accumulate), FP64 1/32 rate, "
                   "GDDR6 352-bit 14 Gbps = 616 GB/s; no BF16 or TF32 units"),
        DeviceSpec(
            "titan-v", fp32_flops=14.9 * TERA, tf32_flops=None, fp16_flops=110 * TERA,
            bf16_flops=None, fp64_flops=7.45 * TERA, bandwidth=652.8 * GIGA,
            launch_overhead=GPU_LAUNCH, flops_efficiency=GPU_FLOPS_EFF,
            bandwidth_efficiency=GPU_BW_EFF, host_link=PCIE3[0], host_bandwidth=PCIE3[1],
            source="NVIDIA TITAN V product page (Volta GV100, 1,455 MHz boost): FP32 14.9 TF, "
                   "110 TF tensor (FP16), FP64 half rate, HBM2 3,072-bit 1.7 Gbps = 652.8 GB/s; "
                   "no BF16 or TF32 units (the GPU of the DTR paper's logs)"),
    )
}

CPU = "cpu"


def known_specs() -> list[str]:
    return [*GPU_SPECS, CPU]


def get_spec(name: str) -> DeviceSpec:
    """The spec called ``name``; ``cpu`` is measured on this machine (cached on disk)."""
    if name == CPU:
        return cpu_spec()
    try:
        return GPU_SPECS[name]
    except KeyError:
        raise UnknownNameError("device spec", name, known_specs()) from None


def cache_dir() -> Path:
    """``$MEMBUDGET_CACHE`` if set, else ``~/.cache/membudget``."""
    env = os.environ.get("MEMBUDGET_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "membudget"


SPEC_LAYOUT = 2  # bumped when measure_cpu measures more: older cached specs are measured again


def _cache_key() -> str:
    return f"torch={torch.__version__};threads={torch.get_num_threads()};layout={SPEC_LAYOUT}"


#: Names a JSON file of one spec's fields (one entry of a ``cpu-spec.json`` cache file) to
#: price CPU ops with instead of this machine's measurement: the same prices, and so the
#: same decisions, on every machine and under any load (the test suite pins one).
PINNED_SPEC_ENV = "MEMBUDGET_CPU_SPEC"


def cpu_spec() -> DeviceSpec:
    """The spec ``$MEMBUDGET_CPU_SPEC`` names, else this machine's measured spec, read from
    the cache file or measured and written to it (keyed by torch version and thread count,
    since both change the numbers)."""
    pinned = os.environ.get(PINNED_SPEC_ENV)
    if pinned:
        return _pinned_spec(pinned)
    return _cpu_spec(str(cache_dir() / "cpu-spec.json"), _cache_key())


@cache
def _pinned_spec(path: str) -> DeviceSpec:
    try:
        fields = json.loads(Path(path).read_text())
        return DeviceSpec(**fields)
    except OSError as e:
        why = f"cannot read it ({e.strerror})"
    except (ValueError, TypeError) as e:
        why = f"not the fields of one device spec ({e})"
    raise MembudgetError(f"${PINNED_SPEC_ENV}={path}: {why}; name a file holding one entry of "
                         f"{cache_dir() / 'cpu-spec.json'}, or unset it to measure this "
                         "machine")


@cache
def _cpu_spec(path: str, key: str) -> DeviceSpec:
    file = Path(path)
    try:
        entries = json.loads(file.read_text())
    except (OSError, ValueError):
        entries = {}
    try:
        return DeviceSpec(**entries[key])
    except (KeyError, TypeError):  # not measured yet, or written by another DeviceSpec layout
        pass
    with _disable_current_modes(), torch.device("cpu"):  # not fake or meta tensors
        spec = measure_cpu()
    entries[key] = asdict(spec)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    tmp.replace(file)
    return spec


# Elementwise ops a CPU core computes slower than it streams their bytes (transcendental
# functions, and the normalizations built on them), each with the shape it is timed at:
# (rows, columns); the last dimension is the one softmax and layer norm reduce.
MATH_BOUND = {"tanh": (1, 1 << 21), "exp": (1, 1 << 21), "log": (1, 1 << 21),
              "sigmoid": (1, 1 << 21), "erf": (1, 1 << 21), "gelu": (1, 1 << 21),
              "silu": (1, 1 << 21), "sin": (1, 1 << 21), "cos": (1, 1 << 21),
              "_softmax": (2048, 1024), "_log_softmax": (2048, 1024),
              "native_layer_norm": (2048, 1024)}


def _math_op(name: str, x: torch.Tensor) -> torch.Tensor:
    """Run :data:`MATH_BOUND` op ``name`` on ``x`` as a model would."""
    op = getattr(torch.ops.aten, name).default
    if name in ("_softmax", "_log_softmax"):
        return op(x, -1, False)
    if name == "native_layer_norm":
        n = x.shape[-1]
        return op(x, [n], torch.ones(n), torch.zeros(n), 1e-5)[0]
    return op(x)


def _math_rates() -> dict[str, float]:
    """Elements per second of each :data:`MATH_BOUND` op on 2M fp32 elements, best of 3."""
    rates = {}
    for name, shape in MATH_BOUND.items():
        x = torch.rand(shape) + 0.5  # (positive: log's fast path, as on real activations)
        rates[name] = x.numel() / _best(lambda name=name, x=x: _math_op(name, x), 3)
    return rates


def measure_cpu() -> DeviceSpec:
    """Measure this CPU in well under 3 s: square matmuls per dtype, a best-of-10 32 MiB copy,
    the median time of a 1-element add (the per-op overhead) and the element rates of the
    :data:`MATH_BOUND` ops."""
    flops = {torch.float32: _matmul_flops(torch.float32, (512, 1024)),
             torch.bfloat16: _matmul_flops(torch.bfloat16, (512, 1024)),
             torch.float16: _matmul_flops(torch.float16, (256,)),
             torch.float64: _matmul_flops(torch.float64, (512,))}
    src = torch.ones(8 << 20)
    dst = torch.empty_like(src)
    copy = _best(lambda: dst.copy_(src), 10)
    a, b = torch.ones(1), torch.ones(1)
    add = torch.ops.aten.add.Tensor
    ticks = []
    for _ in range(300):
        t0 = time.perf_counter_ns()
        add(a, b)
        ticks.append(time.perf_counter_ns() - t0)
    return DeviceSpec(
        CPU, fp32_flops=flops[torch.float32], fp16_flops=flops[torch.float16],
        bf16_flops=flops[torch.bfloat16], tf32_flops=None, fp64_flops=flops[torch.float64],
        bandwidth=2 * src.nbytes / copy, launch_overhead=statistics.median(ticks) * 1e-9,
        math_rates=_math_rates(),
        source=f"measured on this machine ({torch.get_num_threads()} threads, torch "
               f"{torch.__version__}, {time.strftime('%Y-%m-%d')})")


def _matmul_flops(dtype: torch.dtype, sizes: tuple[int, ...]) -> float:
    """Best FLOP/s of two square matmuls at each size: the largest amortize a thread that a
    shared machine deschedules. fp16 and fp64 (rare on CPUs, often slow paths) get one small
    size to stay within the time limit."""
    best = 0.0
    for n in sizes:
        a = torch.ones(n, n, dtype=dtype)
        best = max(best, 2 * n**3 / _best(lambda a=a: a @ a, 2, warm_up=False))
    return best


def _best(fn: Callable[[], object], repeats: int, *, warm_up: bool = True) -> float:
    """Fastest of ``repeats`` timed calls, after one untimed call if ``warm_up``, at the
    thread count of the moment and, if that is more than one, at one thread too: an op
    split over threads waits for the slowest, and on a loaded machine that one waits for a
    scheduler slice (beside one busy process, gelu and layer norm took 12 and 8 ms at 2
    threads, 16 and 20x their idle times), while more threads never make an op slower on an
    idle machine."""
    threads = torch.get_num_threads()
    best = float("inf")
    for n in (threads, 1) if threads > 1 else (threads,):
        torch.set_num_threads(n)
        try:
            if warm_up:
                fn()
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
        finally:
            torch.set_num_threads(threads)
    return best

