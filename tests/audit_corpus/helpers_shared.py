"""Helpers another corpus module imports (``from .helpers_shared import ...``): the audit follows a call
into an audited module's function, and reports the retaining statement here, where the fix belongs."""
import torch


def stash_for_fusion(buffers: dict, name: str, tensor: torch.Tensor) -> None:
    buffers.setdefault(name.split(".")[0], []).append(tensor)  # expect: OWN101


def copy_into(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    param.data.copy_(tensor)
