"""A pretend accelerator for CPU-only machines: the model's tensors claim another device, the data stays real.

Device bugs (a tensor on the model's device meeting one left on the CPU) only
show on a GPU, which this project's machines and CI do not have. Neither
ready-made trick runs a training round on torch 2.13: on the ``meta`` device
``.item()`` and ``.cpu()`` raise (and peft leaves adapters of a meta base on
the CPU), and ``FakeTensorMode`` refuses ``.item()``. So here:

* :class:`OnDevice` is a tensor subclass that reports device ``lazy:0`` (a
  device type every CPU build of torch can route through autograd, which
  ``cuda`` cannot) while holding a real CPU tensor;
* :class:`PretendDevice` is a dispatch mode in which every op runs on the
  real data: results of ops on pretend-device tensors are pretend-device
  tensors, ``.to(device)``/``.cpu()``/``copy_`` move between the two as on a
  GPU, factory functions given the pretend device make pretend-device
  tensors, and an op whose inputs mix pretend-device and CPU tensors (other
  than 0-dim scalars, which PyTorch allows) raises :class:`DeviceMix`, as
  CUDA would.

``torch.tensor`` / ``torch.as_tensor`` with a device bypass dispatch modes,
so while the mode is active they build on the CPU and move.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

PRETEND = torch.device("lazy", 0)


class DeviceMix(RuntimeError):
    """Tensors on the (pretend) accelerator met tensors on the CPU in one op."""


class OnDevice(torch.Tensor):
    """A real CPU tensor (``elem``) that says it lives on :data:`PRETEND`."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=PRETEND,
            requires_grad=elem.requires_grad,
        )

    def __init__(self, elem: torch.Tensor):
        self.elem = elem

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a pretend-device tensor outside PretendDevice")


def _pretend(device) -> bool:
    return device is not None and torch.device(device).type == PRETEND.type


def _unwrap(t):
    return t.elem if isinstance(t, OnDevice) else t


def _wrap(t):
    return OnDevice(t) if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) else t


_tensor, _as_tensor = torch.tensor, torch.as_tensor


def _built_then_moved(maker):
    def make(data, *args, device=None, **kwargs):
        if _pretend(device):
            return maker(data, *args, **kwargs).to(device)
        return maker(data, *args, device=device, **kwargs)

    return make


class PretendDevice(TorchDispatchMode):
    """See module docstring."""

    def __enter__(self):
        torch.tensor, torch.as_tensor = _built_then_moved(_tensor), _built_then_moved(_as_tensor)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.tensor, torch.as_tensor = _tensor, _as_tensor
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            src, target = args[0], kwargs.get("device")
            out = func(_unwrap(src), **{**kwargs, **({"device": torch.device("cpu")} if target else {})})
            moved_here = _pretend(target) or (target is None and isinstance(src, OnDevice))
            return OnDevice(out) if moved_here else out
        if func is torch.ops.aten.copy_.default:  # a copy between devices is a move, allowed as on a GPU
            func(_unwrap(args[0]), _unwrap(args[1]), *args[2:], **kwargs)
            return args[0]
        flat, _ = tree_flatten((args, kwargs))
        tagged = any(isinstance(t, OnDevice) for t in flat)
        plain = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice)]
        if tagged and any(t.dim() > 0 for t in plain):
            shapes = ", ".join(str(tuple(t.shape)) for t in plain if t.dim() > 0)
            raise DeviceMix(f"{func}: tensors on {PRETEND} meet tensors on the CPU of shape {shapes}")
        make_here = _pretend(kwargs.get("device"))
        if make_here:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        return tree_map(_wrap, out) if tagged or make_here else out


def to_pretend_device(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter and buffer of ``module`` moved to the pretend device (call inside the mode)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(OnDevice(p.data), requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = OnDevice(b)
    return module


def pretend_accelerator() -> types.SimpleNamespace:
    """What fedllm reads of an ``accelerate.Accelerator``, for one process on the pretend device."""
    return types.SimpleNamespace(
        device=PRETEND,
        is_main_process=True,
        num_processes=1,
        process_index=0,
        distributed_type="NO",
        mixed_precision="no",
        autocast=contextlib.nullcontext,
        main_process_first=contextlib.nullcontext,
        wait_for_everyone=lambda: None,
        state=None,
    )


def on_cpu(t) -> bool:
    """A plain tensor on the CPU (not on the pretend device)."""
    return isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) and t.device.type == "cpu"
