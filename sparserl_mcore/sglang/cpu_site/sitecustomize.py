"""Run at start-up by every Python process whose PYTHONPATH holds this folder: the SGLang processes
that `sparserl sglang-serve --device cpu` starts (launcher, tokenizer manager, scheduler,
detokenizer). Installs the CPU stand-ins for SGLang's CUDA-only packages
(`sparserl_mcore.sglang.cpu_stubs`), then runs the sitecustomize this one shadows, if any."""

import importlib.util
import os
import sys

from sparserl_mcore.sglang import cpu_stubs

cpu_stubs.install()

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
