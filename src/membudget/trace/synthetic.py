"""A generated trace of one training step of a small residual CNN, built without torch.

The step follows PyTorch autograd: the forward keeps exactly the tensors backward saves (each as
a copied handle, as the DTR logs show saved variables), releases the others when they are dead,
and the backward consumes the saved tensors in reverse order, releasing each after its last use
and each activation gradient once consumed. Plain SGD then updates every parameter in place
(``mut``: copy-on-write in the simulator). Each op's cost is a roofline estimate from its shapes.
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
        self.grad: dict[int, int] = {}  # tensor -> handle of its accumulated gradient
        self.tape: list[Callable[[], None]] = []  # backward closures, in forward order

    # ------------------------------------------------------------------ events
    def emit(self, kind: str, *fields: object) -> None:
        """Append an event; its line is the one it gets in a file written by ``write_trace``."""
        self.events.append((kind, len(self.events) + 2, *fields))

    def _new(self, shape: Shape, itemsize: int | None = None) -> int:
        tid = len(self.shape) + 1
        self.shape[tid] = shape
        self.nbytes[tid] = math.prod(shape) * (itemsize or self.dtype_bytes)
        self.live.add(tid)
        return tid

    def _use(self, tid: int) -> None:
        if tid not in self.live:
            raise AssertionError(f"handle {tid} used while not live")

    def put(self, shape: Shape, kind: str = "param", itemsize: int | None = None) -> int:
        tid = self._new(shape, itemsize)
        self.emit(PUT, tid, self.nbytes[tid], kind)
        if kind == "param":
            self.params.append(tid)
        return tid

    def call(self, op: str, ins: Sequence[int], shapes: Sequence[Shape], flops: float,
             view: bool = False, mut: tuple[int, ...] = ()) -> list[int]:
        """Run ``op``; a ``view`` aliases its first input (0 bytes, launch cost only)."""
        for t in ins:
            self._use(t)
        outs = [self._new(s) for s in shapes]
        alias = tuple(0 if view else -1 for _ in outs)
        out_bytes = tuple(0 if view else self.nbytes[t] for t in outs)
        moved = 0 if view else (sum(self.nbytes[t] for t in ins) + sum(out_bytes)
                                + sum(self.nbytes[ins[m]] for m in mut))
        cost = self.launch_ns + max(flops / self.device_flops, moved / self.device_bw) * 1e9
        self.emit(CALL, op, tuple(ins), tuple(outs), out_bytes, alias, cost, mut)
        return outs

    def release(self, *tids: int) -> None:
        for t in tids:
            self._use(t)
            self.live.remove(t)
            self.emit(RELEASE, t)

    def save(self, t: int) -> int:
        """A new handle to ``t`` held for backward (autograd's saved variable)."""
        self._use(t)
        dst = self._new(self.shape[t])
        self.nbytes[dst] = self.nbytes[t]
        self.emit(COPY, t, dst)
        return dst

    def acc(self, t: int, g: int) -> None:
        """Accumulate gradient ``g`` into that of ``t`` (autograd's input buffer)."""
        old = self.grad.pop(t, None)
        if old is not None:
            (g2,) = self.call("add", [old, g], [self.shape[t]], math.prod(self.shape[t]))
            self.release(old, g)
            g = g2
        self.grad[t] = g

    # ------------------------------------------------------------------ layers
    def conv(self, x: int, w: int, stride: int = 1, keep: bool = False,
             needs_grad: bool = True) -> int:
        n, c, h, wd = self.shape[x]
        co, _, k, _ = self.shape[w]
        shape = (n, co, h // stride, wd // stride)
        flops = 2 * n * co * shape[2] * shape[3] * c * k * k
        (y,) = self.call(f"conv{k}x{k}", [x, w], [shape], flops)
        sx, sw = self.save(x), self.save(w)
        shape_x, shape_w = self.shape[x], self.shape[w]

        def back() -> None:
            g = self.take(y)
            if needs_grad:
                gx, gw = self.call("convolution_backward", [g, sx, sw], [shape_x, shape_w],
                                   2 * flops)
                self.acc(x, gx)
            else:
                (gw,) = self.call("convolution_backward", [g, sx, sw], [shape_w], flops)
            self.release(g, sx, sw)
            self.acc(w, gw)

        self.tape.append(back)
        if not keep:
            self.release(x)
        return y

    def bn(self, x: int, gamma: int, beta: int) -> int:
        shape, c, numel = self.shape[x], self.shape[x][1], math.prod(self.shape[x])
        y, mean, invstd = self.call("batch_norm", [x, gamma, beta], [shape, (c,), (c,)],
                                    8 * numel)
        sx, sg = self.save(x), self.save(gamma)

        def back() -> None:
            g = self.take(y)
            gx, gg, gb = self.call("batch_norm_backward", [g, sx, sg, mean, invstd],
                                   [shape, (c,), (c,)], 12 * numel)
            self.release(g, sx, sg, mean, invstd)
            self.acc(x, gx)
            self.acc(gamma, gg)
            self.acc(beta, gb)

        self.tape.append(back)
        self.release(x)
        return y

    def unary(self, op: str, x: int, shape: Shape, flops: float, back_op: str,
              save_out: bool) -> int:
        """An op with one input that saves its output (relu) or its input (pooling)."""
        (y,) = self.call(op, [x], [shape], flops)
        saved = self.save(y if save_out else x)
        shape_x = self.shape[x]

        def back() -> None:
            g = self.take(y)
            (gx,) = self.call(back_op, [g, saved], [shape_x], flops)
            self.release(g, saved)
            self.acc(x, gx)

        self.tape.append(back)
        self.release(x)
        return y

    def relu(self, x: int) -> int:
        return self.unary("relu", x, self.shape[x], math.prod(self.shape[x]),
                          "threshold_backward", save_out=True)

    def add(self, a: int, b: int) -> int:
        (y,) = self.call("add", [a, b], [self.shape[a]], math.prod(self.shape[a]))

        def back() -> None:
            g = self.take(y)
            g2 = self.save(g)  # the same gradient flows to both inputs
            self.acc(a, g)
            self.acc(b, g2)

        self.tape.append(back)
        self.release(a, b)
        return y

    def flatten(self, x: int) -> int:
        (y,) = self.call("view", [x], [self.shape[x][:2]], 0, view=True)
        shape_x = self.shape[x]

        def back() -> None:
            g = self.take(y)
            (gx,) = self.call("view", [g], [shape_x], 0, view=True)
            self.release(g)
            self.acc(x, gx)

        self.tape.append(back)
        self.release(x)
        return y

    def linear(self, x: int, w: int, b: int) -> int:
        (n, c), (k, _) = self.shape[x], self.shape[w]
        (y,) = self.call("addmm", [b, x, w], [(n, k)], 2 * n * c * k)
        sx, sw = self.save(x), self.save(w)

        def back() -> None:
            g = self.take(y)
            (gx,) = self.call("mm", [g, sw], [(n, c)], 2 * n * c * k)
            (gw,) = self.call("mm", [g, sx], [(k, c)], 2 * n * c * k)
            (gb,) = self.call("sum", [g], [(k,)], n * k)
            self.release(g, sx, sw)
            self.acc(x, gx)
            self.acc(w, gw)
            self.acc(b, gb)

        self.tape.append(back)
        self.release(x)
        return y

    def cross_entropy(self, z: int, labels: int) -> int:
        n, k = self.shape[z]
        p = self.unary("log_softmax", z, (n, k), 5 * n * k, "log_softmax_backward",
                       save_out=True)
        (loss,) = self.call("nll_loss", [p, labels], [()], n)
        sp, sl = self.save(p), self.save(labels)

        def back() -> None:
            g = self.take(loss)
            (gp,) = self.call("nll_loss_backward", [g, sp, sl], [(n, k)], n * k)
            self.release(g, sp, sl)
            self.acc(p, gp)

        self.tape.append(back)
        self.release(p, labels)
        return loss

    def take(self, t: int) -> int:
        return self.grad.pop(t)


def resnet_step(depth: int = 8, batch: int = 32, width: int = 64, image: int = 32,
                dtype_bytes: int = 4, device_flops: float = 10e12, device_bw: float = 500e9,
                launch_ns: float = 5000.0) -> Trace:
    """One SGD training step of a residual CNN with ``depth`` basic blocks (the resolution
    halves and the width doubles at blocks ``depth//3`` and ``2*depth//3``), as a trace."""
    if min(depth, batch, width, image, dtype_bytes) < 1:
        raise ValueError("depth, batch, width, image and dtype_bytes must be >= 1")
    s = _Step(dtype_bytes, device_flops, device_bw, launch_ns)

    def conv_bn(cout: int, cin: int, k: int) -> list[int]:
        return [s.put((cout, cin, k, k)), s.put((cout,)), s.put((cout,))]

    stem = conv_bn(width, 3, 3)
    blocks: list[tuple[bool, list[int]]] = []
    cin = width
    for i in range(depth):
        down = i > 0 and i in (depth // 3, 2 * depth // 3)
        cout = 2 * cin if down else cin
        params = conv_bn(cout, cin, 3) + conv_bn(cout, cout, 3)
        blocks.append((down, params + conv_bn(cout, cin, 1) if down else params))
        cin = cout
    fc_w, fc_b = s.put((CLASSES, cin)), s.put((CLASSES,))
    x = s.put((batch, 3, image, image), "input")
    labels = s.put((batch,), "input", itemsize=8)

    s.emit(PHASE, "forward")
    h = s.relu(s.bn(s.conv(x, stem[0], needs_grad=False), *stem[1:]))
    for down, p in blocks:
        stride = 2 if down else 1
        y = s.relu(s.bn(s.conv(h, p[0], stride, keep=True), p[1], p[2]))
        y = s.bn(s.conv(y, p[3]), p[4], p[5])
        skip = s.bn(s.conv(h, p[6], 2), p[7], p[8]) if down else h
        h = s.relu(s.add(y, skip))
    n, c, hh, ww = s.shape[h]
    pooled = s.unary("adaptive_avg_pool2d", h, (n, c, 1, 1), n * c * hh * ww,
                     "adaptive_avg_pool2d_backward", save_out=False)
    loss = s.cross_entropy(s.linear(s.flatten(pooled), fc_w, fc_b), labels)

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
