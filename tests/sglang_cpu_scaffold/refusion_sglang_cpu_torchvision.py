"""CPU TEST SCAFFOLDING: lets ``import torchvision`` succeed in ``.venv-sglang`` without torchvision's CUDA build.

SGLang 0.5.23 imports ``torchvision.transforms`` at start-up (``sglang/srt/configs`` -> ``multimodal/internvl_utils``)
even for text models. The registry's torchvision wheels are CUDA builds: their ``_C.so`` links ``libc10_cuda`` and
does not load over the CPU torch wheel. ``make sglang`` installs the wheel's pure-Python part (extension modules
deleted); torchvision then reports its ops as absent, but its ``_meta_registrations`` still registers fake kernels
for ``torchvision::nms`` / ``qnms`` unconditionally, which needs the ops' schemas. This module declares those two
schemas (no kernel: calling them raises torch's "no kernel" error). A ``.pth`` line written by ``make sglang``
imports it at interpreter start in that venv only, and only when torchvision's extension is missing.
"""

import importlib.util

if importlib.util.find_spec("torchvision") is not None:
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018  (raises when the op is not declared)
    except (AttributeError, RuntimeError):
        _lib = torch.library.Library("torchvision", "DEF")
        _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
