"""A pytest plugin that runs transformers' own tests (a checkout of their tests/ tree, never copied here) with the
accelerator on: `import mindspeed_hf` before any model is built, as a user script does (`MINDSPEED_HF_AUTO=0` runs
the same tests without it, for the baseline). After each test it prints what `mindspeed_hf.report(model)` says ran on
the models that test generated with, so a pass is known to have gone through our kernels.

`HF_OWN_COMPILE_BACKEND=aot_eager` makes transformers' `CompileConfig` default to that backend: Dynamo and AOT
autograd in full, inductor's C++ code generation left out (minutes per model on a 2-core CPU). The name has no
MINDSPEED_HF_ prefix: the package refuses unknown variables of its own.
Used through run_hf_tests.sh."""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Iterator

import pytest

import mindspeed_hf

_GENERATED: weakref.WeakSet = weakref.WeakSet()


def _record_generating_models(generate: Callable) -> Callable:
    """Wrap `GenerationMixin.generate` so the models a test generates with can be reported after it."""

    @functools.wraps(generate)
    def wrapper(self, *args, **kwargs):
        _GENERATED.add(self)
        return generate(self, *args, **kwargs)

    wrapper.__wrapped_by_mindspeed_hf_on__ = True
    return wrapper


def _default_compile_backend(backend: str) -> None:
    """Make `CompileConfig()` default to `backend` (an explicit `backend=` still wins)."""
    from transformers.generation.configuration_utils import CompileConfig

    init = CompileConfig.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("backend", backend)
        init(self, *args, **kwargs)

    CompileConfig.__init__ = __init__


def pytest_configure(config: pytest.Config) -> None:  # noqa: ARG001 - pytest's hook signature
    from transformers.generation.utils import GenerationMixin

    if not getattr(GenerationMixin.generate, "__wrapped_by_mindspeed_hf_on__", False):
        GenerationMixin.generate = _record_generating_models(GenerationMixin.generate)
    backend = os.environ.get("HF_OWN_COMPILE_BACKEND")
    if backend:
        _default_compile_backend(backend)


def _summary(model) -> str:
    """One line of `mindspeed_hf.report(model)`: the backend and the kernels that ran in eager forwards."""
    report = mindspeed_hf.report(model)
    ran = {name: count for name, count in (report.get("ran") or {}).items() if count}
    return (f"{type(model).__name__}: backend={report.get('backend')} "
            f"attention={report.get('attention_implementation')} ran={ran}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _GENERATED.clear()
    yield
    lines = [_summary(model) for model in list(_GENERATED)]
    item.add_report_section("call", "mindspeed_hf", "\n".join(lines) or "no model generated")
    print(f"\n[mindspeed_hf] {item.nodeid}: " + ("; ".join(lines) or "no model generated"))
