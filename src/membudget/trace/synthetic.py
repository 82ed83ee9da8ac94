"""A generated trace of one SGD training step of a small residual CNN, built without torch.

It follows PyTorch autograd: the forward keeps exactly the tensors backward saves (as copied
handles, like the DTR logs' saved variables); backward releases each after its last use and
each activation gradient once consumed; parameter gradients live until the optimizer step,
which updates every parameter in place (``mut``). Op costs are roofline estimates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from membudget.trace.format import CALL, COPY, GET, PHASE, PUT, RELEASE, Event, Trace

Shape = tuple[int, ...]
CLASSES = 10
_DTYPES = {2: "float16", 4: "float32", 8: "float64"}


class _Step:
    """Emits the events of one step and tracks which handles are live."""

    def __init__(self, dtype_bytes: int, device_flops: float, device_bw: float,
                 launch_ns: float) -> None:
        self.dtype_bytes = dtype_bytes
        self.device_flops, self.device_bw, self.launch_ns = device_flops, device_bw, launch_ns
        self.events: list[Event] = []
        self.shape: dict[int, Shape] = {}
        self.nbytes: dict[int, int] = {}  # logical size (a view's own bytes are 0 in the trace)
        self.live: set[int] = set()
        self.params: list[int] = []
        self.grad: dict[int, int] = {}  # tensor -> handle of its gradient so far
        self.tape: list[Callable[[], None]] = []  # backward closures, in forward order

    def emit(self, kind: str, *fields: object) -> None:
        """Append an event; its line is the one it gets in a file written by ``write_trace``."""
        self.events.append((kind, len(self.events) + 2, *fields))

    def _new(self, shape: Shape, nbytes: int | None = None) -> int:
        tid = len(self.shape) + 1
        self.shape[tid] = shape
        self.nbytes[tid] = math.prod(shape) * self.dtype_bytes if nbytes is None else nbytes
        self.live.add(tid)
        return tid

    def _use(self, tids: Sequence[int]) -> None:
        if dead := [t for t in tids if t not in self.live]:
            raise AssertionError(f"handles {dead} used while not live")

    def put(self, shape: Shape, kind: str = "param", itemsize: int | None = None) -> int:
        tid = self._new(shape, math.prod(shape) * (itemsize or self.dtype_bytes))
        self.emit(PUT, tid, self.nbytes[tid], kind)
        if kind == "param":
            self.params.append(tid)
        return tid

    def call(self, op: str, ins: Sequence[int], shapes: Sequence[Shape], flops: float,
             view: bool = False, mut: tuple[int, ...] = ()) -> list[int]:
        """Run ``op``; a ``view`` aliases its first input (0 bytes, launch cost only)."""
        self._use(ins)
        outs = [self._new(s) for s in shapes]
        out_bytes = tuple(0 if view else self.nbytes[t] for t in outs)
        moved = 0 if view else (sum(self.nbytes[t] for t in ins) + sum(out_bytes)
                                + sum(self.nbytes[ins[m]] for m in mut))
        cost = self.launch_ns + max(flops / self.device_flops, moved / self.device_bw) * 1e9
        alias = tuple(0 if view else -1 for _ in outs)
        self.emit(CALL, op, tuple(ins), tuple(outs), out_bytes, alias, cost, mut)
        return outs

    def release(self, *tids: int) -> None:
        self._use(tids)
        for t in tids:
            self.live.remove(t)
            self.emit(RELEASE, t)

    def save(self, t: int) -> int:
        """A new handle to ``t``, held for backward (autograd's saved variable)."""
        self._use([t])
        dst = self._new(self.shape[t], self.nbytes[t])
        self.emit(COPY, t, dst)
        return dst

    def acc(self, t: int, g: int) -> None:
        """Accumulate gradient ``g`` into that of ``t`` (autograd's input buffer)."""
        if (old := self.grad.pop(t, None)) is not None:
            (total,) = self.call("add", [old, g], [self.shape[t]], math.prod(self.shape[t]))
            self.release(old, g)
            g = total
        self.grad[t] = g

    # ------------------------------------------------------------------ layers
    def conv(self, x: int, w: int, stride: int = 1, keep: bool = False,
             grad_input: bool = True) -> int:
        sx_shape, sw_shape = self.shape[x], self.shape[w]
        (n, c, h, wd), (co, _, k, _) = sx_shape, sw_shape
        shape = (n, co, -(-h // stride), -(-wd // stride))  # padded: ceil(h / stride)
        flops = 2 * n * co * shape[2] * shape[3] * c * k * k
        (y,) = self.call(f"conv{k}x{k}", [x, w], [shape], flops)
        sx, sw = self.save(x), self.save(w)

        def back() -> None:
            g = self.grad.pop(y)
            shapes = [sx_shape, sw_shape] if grad_input else [sw_shape]
            grads = self.call("convolution_backward", [g, sx, sw], shapes,
                              flops * len(shapes))
            self.release(g, sx, sw)
            if grad_input:
                self.acc(x, grads[0])
            self.acc(w, grads[-1])

        self.tape.append(back)
        if not keep:
            self.release(x)
        return y

    def bn(self, x: int, gamma: int, beta: int) -> int:
        shape, numel = self.shape[x], math.prod(self.shape[x])
        c = (shape[1],)
        y, mean, invstd = self.call("batch_norm", [x, gamma, beta], [shape, c, c], 8 * numel)
        sx, sg = self.save(x), self.save(gamma)

        def back() -> None:
            g = self.grad.pop(y)
            gx, gg, gb = self.call("batch_norm_backward", [g, sx, sg, mean, invstd],
                                   [shape, c, c], 12 * numel)
            self.release(g, sx, sg, mean, invstd)
            for t, gt in ((x, gx), (gamma, gg), (beta, gb)):
                self.acc(t, gt)

        self.tape.append(back)
        self.release(x)
        return y

    def unary(self, op: str, x: int, shape: Shape, flops: float, back_op: str,
              save_out: bool = True, view: bool = False) -> int:
        """A one-input op that saves its output (relu), its input (pooling) or nothing (view)."""
        (y,) = self.call(op, [x], [shape], flops, view)
        saved = [] if view else [self.save(y if save_out else x)]
        shape_x = self.shape[x]

        def back() -> None:
            g = self.grad.pop(y)
            (gx,) = self.call(back_op, [g, *saved], [shape_x], flops, view)
            self.release(g, *saved)
            self.acc(x, gx)

        self.tape.append(back)
        self.release(x)
        return y

    def add(self, a: int, b: int) -> int:
        (y,) = self.call("add", [a, b], [self.shape[a]], math.prod(self.shape[a]))

        def back() -> None:
            g = self.grad.pop(y)
            g2 = self.save(g)  # the same gradient flows to both inputs
            self.acc(a, g)
            self.acc(b, g2)

        self.tape.append(back)
        self.release(a, b)
        return y

    def linear(self, x: int, w: int, b: int) -> int:
        (n, c), (k, _) = self.shape[x], self.shape[w]
        flops = 2 * n * c * k
        (y,) = self.call("addmm", [b, x, w], [(n, k)], flops)
        sx, sw = self.save(x), self.save(w)

        def back() -> None:
            g = self.grad.pop(y)
            (gx,) = self.call("mm", [g, sw], [(n, c)], flops)
            (gw,) = self.call("mm", [g, sx], [(k, c)], flops)
            (gb,) = self.call("sum", [g], [(k,)], n * k)
            self.release(g, sx, sw)
            for t, gt in ((x, gx), (w, gw), (b, gb)):
                self.acc(t, gt)

        self.tape.append(back)
        self.release(x)
        return y

    def cross_entropy(self, z: int, labels: int) -> int:
        n, k = self.shape[z]
        p = self.unary("log_softmax", z, (n, k), 5 * n * k, "log_softmax_backward")
        (loss,) = self.call("nll_loss", [p, labels], [()], n)
        sp, sl = self.save(p), self.save(labels)

        def back() -> None:
            g = self.grad.pop(loss)
            (gp,) = self.call("nll_loss_backward", [g, sp, sl], [(n, k)], n * k)
            self.release(g, sp, sl)
            self.acc(p, gp)

        self.tape.append(back)
        self.release(p, labels)
        return loss


def resnet_step(depth: int = 8, batch: int = 32, width: int = 64, image: int = 32,
                dtype_bytes: int = 4, device_flops: float = 10e12, device_bw: float = 500e9,
                launch_ns: float = 5000.0) -> Trace:
    """One SGD training step of a residual CNN with ``depth`` basic blocks (the resolution
    halves and the width doubles at blocks ``depth//3`` and ``2*depth//3``), as a trace."""
    if min(depth, batch, width, image, dtype_bytes) < 1:
        raise ValueError("depth, batch, width, image and dtype_bytes must be >= 1")
    s = _Step(dtype_bytes, device_flops, device_bw, launch_ns)

    def relu(t: int) -> int:
        return s.unary("relu", t, s.shape[t], math.prod(s.shape[t]), "threshold_backward")

    def conv_bn(cout: int, cin: int, k: int) -> list[int]:
        return [s.put((cout, cin, k, k)), s.put((cout,)), s.put((cout,))]

    stem, cin = conv_bn(width, 3, 3), width
    blocks: list[tuple[bool, list[int]]] = []
    for i in range(depth):
        down = i > 0 and i in (depth // 3, 2 * depth // 3)
        cout = 2 * cin if down else cin
        params = conv_bn(cout, cin, 3) + conv_bn(cout, cout, 3)
        blocks.append((down, params + conv_bn(cout, cin, 1) if down else params))
        cin = cout
    fc_w, fc_b = s.put((CLASSES, cin)), s.put((CLASSES,))
    x = s.put((batch, 3, image, image), "input")
    labels = s.put((batch,), "input", itemsize=8)  # int64 class indices

    s.emit(PHASE, "forward")
    h = relu(s.bn(s.conv(x, stem[0], grad_input=False), *stem[1:]))
    for down, bp in blocks:
        y = relu(s.bn(s.conv(h, bp[0], 2 if down else 1, keep=True), bp[1], bp[2]))
        y = s.bn(s.conv(y, bp[3]), bp[4], bp[5])
        skip = s.bn(s.conv(h, bp[6], 2), bp[7], bp[8]) if down else h
        h = relu(s.add(y, skip))
    n, c, hh, ww = s.shape[h]
    h = s.unary("adaptive_avg_pool2d", h, (n, c, 1, 1), n * c * hh * ww,
                "adaptive_avg_pool2d_backward", save_out=False)
    h = s.unary("view", h, (n, c), 0, "view", view=True)  # flatten: a view, 0 bytes
    loss = s.cross_entropy(s.linear(h, fc_w, fc_b), labels)

    s.emit(PHASE, "backward")
    (s.grad[loss],) = s.call("ones_like", [loss], [()], 0)
    for back in reversed(s.tape):
        back()
    assert set(s.grad) == set(s.params), "a gradient was left unconsumed"

    s.emit(PHASE, "optimizer")
    for p in s.params:
        g = s.grad.pop(p)
        s.call("sgd_", [p, g], [], 2 * math.prod(s.shape[p]), mut=(0,))
        s.release(g)
    s.emit(GET, loss)  # loss.item()

    header = {"model": f"resnet{2 * depth + 2}-synthetic", "batch": batch,
              "dtype": _DTYPES.get(dtype_bytes, f"{8 * dtype_bytes}-bit"), "device": "synthetic",
              "cost_unit": "ns", "cost_source": "roofline model",
              "source": "membudget.trace.synthetic"}
    return Trace(header, s.events, "<synthetic>")
