"""The seam to evaluate's module globals (see `refusion_hf._compat`); tests/_compat/test_evaluate.py checks it
against the installed evaluate and lm-eval.

`evaluate.load` is public, but replacing it is not an API: evaluate has no registry through which a local metric
could answer for a Hub metric name, and lm-eval's code tasks call `evaluate.load("code_eval")` themselves (by the
module attribute, at call time), so the replacement is made on the module, within a block, and undone after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

PRIVATE_MEMBERS = ()  # no private name: the replaced global is `evaluate.load`, which the seam test checks


@contextlib.contextmanager
def replacing_load(metric: str, build: Callable[[], object]) -> Iterator[None]:
    """Within this block `evaluate.load(metric)` (any path ending in `metric`) returns `build()`; other loads are
    untouched."""
    import evaluate

    real_load = evaluate.load

    def load(path, *args, **kwargs):
        if str(path).rstrip("/").split("/")[-1] == metric:
            return build()
        return real_load(path, *args, **kwargs)

    evaluate.load = load
    try:
        yield
    finally:
        evaluate.load = real_load
