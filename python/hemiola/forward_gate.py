"""Where, in the next forward, each parameter must be brought up to date.

The schedules that update parameters after ``backward()`` returns
(``priority``, ``decoupled``) bring a parameter up to date just before the
first module that reads it runs its forward. Which module that is cannot be
read off the module tree: ``nn.MultiheadAttention`` reads
``out_proj.weight`` without calling ``out_proj``, tied weights are owned by
two modules, and any module may read a sibling's parameter functionally.

So the first training forward is observed: a ``TorchFunctionMode`` sees
every torch call with its arguments, and the first call that reads a
parameter names the innermost module running at that moment; its forward
pre-hook ran before the read, so that is where the parameter is landed from
then on. Parameters that first forward did not read are landed by the
wrapped module's own pre-hook (the very start of the forward), which is
always early enough.

A module compiled before wrapping (``torch.compile(model)``) runs its whole
forward as compiled graphs, with no place in between for a landing, so
everything lands in its own pre-hook, which runs eagerly.

The forward gate hands its result over as integers: gate 0 is "every parameter"
(the start of the forward), gates 1.. are the modules' pre-hooks, each with
the parameter indices it lands. The engine's updater keeps that table and the
per-iteration work; a pre-hook makes one call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: called as land(gate, indices) when a forward reaches a gate
Land = Callable[[int, list[int]], None]
#: called with the gates (indices per gate) whenever they change
Learnt = Callable[[list[list[int]]], None]


class _FirstReads(TorchFunctionMode):
    """Records, for each parameter, the module running when a torch call
    first read it."""

    def __init__(self, index_of: dict[int, int], stack: list[nn.Module]) -> None:
        super().__init__()
        self.index_of = index_of
        self.stack = stack
        self.reader: dict[int, nn.Module] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for tensor in _tensors((args, kwargs)):
            index = self.index_of.get(id(tensor))
            if index is not None and index not in self.reader:
                self.reader[index] = self.stack[-1]
        return func(*args, **kwargs)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a torch call's arguments (nested lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class ForwardGate:
    """Calls ``land(gate, indices)`` in the forward pre-hook of the module
    that reads parameters ``indices`` first (learnt in the first forward with
    gradients enabled; until then the root module lands everything as gate
    0), and ``learnt(gates)`` when the gates change."""

    def __init__(self, root: nn.Module, params: list[torch.Tensor], land: Land,
                 learnt: Learnt | None = None) -> None:
        self._root = root
        self._params = params
        self._land = land
        self._learnt_callback = learnt
        self._all = list(range(len(params)))
        # A compiled module: nothing to learn, everything lands at the start.
        self._learnt = isinstance(root, torch._dynamo.eval_frame.OptimizedModule)
        self._compiled = False  # the wrapper's forward is compiled
        #: per parameter index: the module whose pre-hook lands it
        self.gate_of: dict[int, nn.Module] = dict.fromkeys(self._all, root)
        #: per gate: the parameter indices it lands (0: all of them)
        self.gates: list[list[int]] = [self._all]
        self._handles: list[Any] = [root.register_forward_pre_hook(self._land_all)]

    @property
    def learning(self) -> bool:
        """The next forward (if it runs with gradients) is observed."""
        return not self._learnt and torch.is_grad_enabled()

    def land_at_start_only(self) -> None:
        """From now on everything lands at the start of the forward (the
        forward runs compiled; see the module docstring)."""
        if self._compiled:
            return
        self._compiled = True
        self._learnt = True
        self.gate_of = dict.fromkeys(self._all, self._root)
        self.gates = [self._all]
        self.remove()
        if self._learnt_callback is not None:
            self._learnt_callback(self.gates)

    def land_now(self) -> None:
        """Lands everything (the forward starts, compiled)."""
        if self._compiled:
            self._land_all(self._root, ())

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Wraps one forward of the wrapped module; the first one with
        gradients enabled is observed to learn the landing points."""
        if self._learnt or not torch.is_grad_enabled():
            yield
            return
        stack: list[nn.Module] = [self._root]
        index_of = {id(p): i for i, p in enumerate(self._params)}

        def enter(module: nn.Module, args: Any) -> None:
            stack.append(module)

        def leave(module: nn.Module, args: Any, out: Any) -> None:
            stack.pop()  # (a forward hook that returns a value replaces the output)

        handles = []
        for module in self._root.modules():
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave, always_call=True))
        reads = _FirstReads(index_of, stack)
        try:
            with reads:
                yield
        finally:
            for h in handles:
                h.remove()
        self._install(reads.reader)

    def _install(self, reader: dict[int, nn.Module]) -> None:
        by_module: dict[nn.Module, list[int]] = {}
        for i in self._all:
            module = reader.get(i, self._root)
            self.gate_of[i] = module
            by_module.setdefault(module, []).append(i)
        for h in self._handles:
            h.remove()
        self.gates = [self._all, *by_module.values()]
        self._handles = [module.register_forward_pre_hook(self._hook(gate, indices))
                         for gate, (module, indices) in enumerate(by_module.items(), 1)]
        self._learnt = True
        if self._learnt_callback is not None:
            self._learnt_callback(self.gates)

    def _hook(self, gate: int, indices: list[int]) -> Callable[[nn.Module, Any], None]:
        land = self._land

        def hook(module: nn.Module, args: Any) -> None:
            land(gate, indices)
        return hook

    def _land_all(self, module: nn.Module, args: Any) -> None:
        self._land(0, self._all)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
