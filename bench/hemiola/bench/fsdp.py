"""The baseline of ``sharded``: torch's FSDP2 (``fully_shard``) as its users
apply it, over the default process group (Gloo on the CPU here).

``reshard_after_forward=False`` is ZeRO-2: parameters are all-gathered
before each unit's forward and stay whole until its backward is done, the
gradients are reduce-scattered during backward, and each rank's optimizer
steps its own shard of the parameters, gradients and optimizer state, which
is what hemiola's ``sharded`` does (it all-gathers the updated shard under the
next forward instead of before it). The optimizer is built after sharding,
over the sharded parameters (DTensors), as FSDP2 requires.
"""

from __future__ import annotations

from torch import nn

#: how FSDP2 reads in a table
LABEL = "torch FSDP2 (fully_shard, ZeRO-2)"


def _is_stack(module: nn.Module) -> bool:
    """Whether `module` is a stack of blocks rather than a block: a
    ModuleList, a module holding one (``nn.TransformerEncoder``), or a
    Sequential whose parametrised children are all composite (torchvision's
    ResNet stages); a Sequential of leaf layers (a conv-BN-ReLU block) is a
    block."""
    if isinstance(module, nn.ModuleList):
        return True
    if any(isinstance(c, nn.ModuleList) for c in module.children()):
        return True
    if isinstance(module, nn.Sequential):
        parametrised = [c for c in module.children() if any(True for _ in c.parameters())]
        return bool(parametrised) and all(any(True for _ in c.children())
                                          for c in parametrised)
    return False


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 users shard one by one before the root: each child
    of `model` that holds parameters, and inside stacks of blocks (a
    transformer's layers, a ResNet stage) each block. Parameters outside
    every unit go to the root's own group."""
    units: list[nn.Module] = []
    for child in model.children():
        if not any(True for _ in child.parameters()):
            continue
        if _is_stack(child):
            units += shard_units(child)
        else:
            units.append(child)
    return units


def fully_shard_model(model: nn.Module, reshard_after_forward: bool = False) -> nn.Module:
    """`model` sharded in place with FSDP2 over every rank of the default
    process group: ``fully_shard`` on each of :func:`shard_units`, then on
    the root. Returns `model` (FSDP2 changes its class, not its identity).
    Build the optimizer afterwards, over ``model.parameters()``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError("the fsdp2 baseline runs on CPU parameters over Gloo in this bench "
                         f"(got {device})")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model
