"""CP-SAT as a decision procedure for packing: ``NoOverlap2D`` of the fixed lifetime
intervals and the offset intervals, every offset within [floor, goal)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from ortools.sat.python import cp_model

from membudget.plan import interrupt
from membudget.plan.packing.canonical import Interrupted, Stop
from membudget.plan.packing.instance import Instance


class CpSat:
    """Decides "does a packing fit under ``goal``?" for an instance, optionally with each
    buffer's lowest offset (``floor``) and fixed boxes to avoid (``obstacles``: rows of
    lower, upper, offset, size in the instance's units) and a ``hint`` of offsets to start
    from. Whole problems get no hint: the incumbent lies above the goal, and such a hint
    misleads; a window's incumbent is mostly below it."""

    def __init__(self, inst: Instance, workers: int, floor: np.ndarray | None = None,
                 obstacles: np.ndarray | None = None, hint: np.ndarray | None = None) -> None:
        self.inst = inst
        self.floor = np.zeros(len(inst), dtype=np.int64) if floor is None else floor
        self.obstacles = np.zeros((0, 4), dtype=np.int64) if obstacles is None else obstacles
        self.hint = hint
        self.solver = cp_model.CpSolver()
        self.solver.parameters.num_workers = workers
        # Ctrl-C is ours to handle (:mod:`membudget.plan.interrupt`): CP-SAT's own handler
        # swallows it in the main thread and aborts the process from another
        # (std::bad_function_call)
        self.solver.parameters.catch_sigint_signal = False
        self.watch: Callable[[], bool] | None = None

    def __call__(self, goal: int, stop: Stop) -> np.ndarray | None:
        """Offsets (units) of a packing under ``goal``, or None if none exists; raises
        Interrupted once ``poll`` sees ``stop()`` turn true."""
        if int((self.floor + self.inst.size).max(initial=0)) > goal:
            return None
        model, ys = self._model(goal)
        return self._solve(model, ys, stop)

    def lowest(self, ceiling: int, stop: Stop) -> np.ndarray | None:
        """Offsets (units) under ``ceiling`` with the lowest top CP-SAT finds in its time
        limit, starting from the hint (which must be valid); None if it finds none."""
        model, ys = self._model(ceiling)
        top = model.new_int_var(0, ceiling, "top")
        for y, s in zip(ys, self.inst.size.tolist(), strict=True):
            model.add(top >= y + s)
        if self.hint is not None:  # a complete hint is a first solution
            model.add_hint(top, int((self.hint + self.inst.size).max(initial=0)))
        model.minimize(top)
        return self._solve(model, ys, stop, timeout_ok=True)

    def _model(self, goal: int) -> tuple[cp_model.CpModel, list[cp_model.IntVar]]:
        """The packing model with every offset within [floor, goal)."""
        inst = self.inst
        model = cp_model.CpModel()
        ys, xs, yi = [], [], []
        for i, (lo, hi, s, f) in enumerate(zip(inst.lo.tolist(), inst.hi.tolist(),
                                                inst.size.tolist(), self.floor.tolist(),
                                                strict=True)):
            y = model.new_int_var(f, goal - s, f"y{i}")
            ys.append(y)
            xs.append(model.new_fixed_size_interval_var(lo, hi - lo, f"t{i}"))
            yi.append(model.new_fixed_size_interval_var(y, s, f"a{i}"))
        for k, (lo, hi, off, s) in enumerate(self.obstacles.tolist()):
            xs.append(model.new_fixed_size_interval_var(lo, hi - lo, f"ot{k}"))
            yi.append(model.new_fixed_size_interval_var(off, s, f"oa{k}"))
        model.add_no_overlap_2d(xs, yi)
        if self.hint is not None:
            for y, h in zip(ys, self.hint.tolist(), strict=True):
                model.add_hint(y, h)
        return model, ys

    def _solve(self, model: cp_model.CpModel, ys: list[cp_model.IntVar], stop: Stop,
               timeout_ok: bool = False) -> np.ndarray | None:
        """Solve; the offsets, None if infeasible (or, with ``timeout_ok``, if nothing was
        found in time); raises Interrupted on a timeout (or Ctrl-C) otherwise."""
        self.watch = stop
        try:
            with interrupt.stopping(self.solver.stop_search):
                status = self.solver.solve(model)
        finally:
            self.watch = None
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return np.array([self.solver.value(y) for y in ys], dtype=np.int64)
        if status == cp_model.INFEASIBLE or timeout_ok:
            return None
        raise Interrupted

    def poll(self) -> None:
        """Stop the running solve if its ``stop()`` is true (CP-SAT cannot poll itself)."""
        watch = self.watch
        if watch is not None and watch():
            self.solver.stop_search()
