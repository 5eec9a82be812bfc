"""The user's optimizer under ``sharded``: its param groups point at this
rank's shard (views of the pieces of the parameters that fall in its
chunks), so torch's own step updates only the shard, in place in the
parameters, and creates state for it alone. Exact only for optimizers whose
step is element-wise (a piece steps as its elements would inside the whole
tensor); the others are refused by name."""

from __future__ import annotations

from typing import Any

import torch

from hemiola.schedules.sharded_plan import ShardPlan

#: torch's optimizers whose step is element-wise: exact on any piece of a
#: parameter (their per-parameter scalars, such as Adam's step count, are the
#: same for every piece). Adafactor (factored second moments), L-BFGS (a
#: global line search) and SparseAdam are not.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
               torch.optim.Rprop, torch.optim.Adadelta, torch.optim.ASGD)


def refuse_non_elementwise(optimizer: Any) -> None:
    """Raises unless `optimizer` steps each element on its own."""
    if isinstance(optimizer, ELEMENTWISE):
        return
    names = ", ".join(cls.__name__ for cls in ELEMENTWISE)
    raise ValueError(
        f"schedule='sharded' steps each rank's shard of every parameter, which cuts "
        f"parameters into pieces: {type(optimizer).__name__} is not one of the optimizers "
        f"whose step is element-wise ({names}), so its step on a piece could differ from "
        "its step on the whole tensor. Use one of those, or schedule='priority' or 'wfbp' "
        "(every rank holds the whole optimizer state).")


def refuse_scattered(names: list[str], params: list[torch.Tensor]) -> None:
    """A shard is a view of the flattened parameter: parameters must be
    contiguous."""
    for name, p in zip(names, params):
        if not p.is_contiguous():
            raise ValueError(
                f"schedule='sharded': parameter {name!r} is not contiguous (shape "
                f"{tuple(p.shape)}, strides {p.stride()}), and its shard is a view of the "
                "flattened parameter. Make it contiguous before wrapping (e.g. "
                "module.weight = nn.Parameter(module.weight.detach().contiguous())), or use "
                "schedule='wfbp'.")


class ShardedOptimizer:
    """Re-points `optimizer`'s param groups at the shard of a plan (see the
    module docstring). The groups keep their hyper-parameters, so LR
    schedulers and ``param_groups`` edits work as before."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self._params = params
        index = {id(p): i for i, p in enumerate(params)}
        #: per param group: the indices of the model's parameters it held
        self.group_indices: list[list[int]] = [
            [index[id(p)] for p in group["params"] if id(p) in index]
            for group in optimizer.param_groups]
        #: per parameter index: this rank's view of its piece (None: no piece)
        self.views: list[torch.Tensor | None] = [None] * len(params)

    def point_at(self, plan: ShardPlan) -> None:
        """Makes the groups hold the views of `plan`'s pieces. State held for
        the views of an earlier plan is dropped (ShardedState moves it)."""
        self.views = [None] * len(self._params)
        for i, piece in plan.piece_of.items():
            flat = self._params[i].detach().view(-1)
            self.views[i] = flat[piece.begin:piece.begin + piece.count]
        for group, indices in zip(self.optimizer.param_groups, self.group_indices):
            group["params"] = [self.views[i] for i in indices if self.views[i] is not None]
        self.optimizer.state.clear()

    def refresh(self, plan: ShardPlan) -> None:
        """The parameters' storage changed (``load_state_dict(assign=True)``):
        new views of the same pieces, each keeping its optimizer state."""
        old = self.views
        state = {i: self.optimizer.state[v] for i, v in enumerate(old)
                 if v is not None and v in self.optimizer.state}
        self.point_at(plan)
        for i, entry in state.items():
            view = self.views[i]
            assert view is not None
            self.optimizer.state[view] = entry

    def set_grads(self, grads: dict[int, torch.Tensor | None]) -> None:
        """Each view's gradient for the next step (None: not stepped)."""
        for i, view in enumerate(self.views):
            if view is not None:
                view.grad = grads.get(i)
