"""Lets the CUDA torchvision wheel import on CPU torch (CPU-ONLY, development).

PyPI's torchvision 0.28.0 is a CUDA build; with CPU torch its C++ ops library does not
load, and `torchvision/_meta_registrations.py` then fails at import on its unguarded
`@torch.library.register_fake("torchvision::nms")` (and `qnms`): the operators were never
defined. SGLang imports torchvision on its server path. Instead of editing torchvision's
files, an import hook (installed by a .pth file, so it exists in every interpreter of the
venv, including SGLang's spawned scheduler processes) defines the two operator schemas
just before that module runs. The ops stay unusable: torchvision.ops.nms still calls
`_assert_has_ops()` and raises its own clear error. The hook does nothing once
torchvision's real ops are loaded, and imports torch only when torchvision is imported.
"""

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
# Holds the torch.library.Library that owns the definitions: dropping it undefines them.
_defined_library: list[object] = []


def define_missing_torchvision_ops() -> None:
    import torch
    import torchvision.extension

    if torchvision.extension._has_ops() or _defined_library:
        return
    library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS.values():
        try:
            library.define(schema)
        except RuntimeError:
            pass  # already defined elsewhere: nothing to do
    _defined_library.append(library)


class TorchvisionOpsImportHook(importlib.abc.MetaPathFinder):
    """Runs `define_missing_torchvision_ops` when `torchvision._meta_registrations` is found.

    It finds nothing itself (returns None): the normal finders load the real module.
    """

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == _TARGET:
            define_missing_torchvision_ops()
        return None


def install_import_hook() -> None:
    if not any(isinstance(finder, TorchvisionOpsImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, TorchvisionOpsImportHook())
