"""`import mindspeed_hf` loads what a run applies: the parallel axes, context parallelism and activation offload are
imported by the step that applies them (docs/host_time.md), while every public name stays importable."""

import importlib
import subprocess
import sys

import pytest

LAZY_PACKAGES = ("mindspeed_hf.parallel", "mindspeed_hf.parallel.context", "mindspeed_hf.memory")


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_public_name_resolves_and_is_listed(package):
    module = importlib.import_module(package)
    for name in module.__all__:
        value = getattr(module, name)
        assert not isinstance(value, type(sys)), f"{package}.{name} is a module, not the exported {name}"
        assert name in dir(module)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018


def test_enabled_import_leaves_the_unused_steps_unloaded():
    from child_runs import child_env

    script = (
        "import sys, mindspeed_hf\n"
        "assert mindspeed_hf.is_enabled()\n"
        "optional = ['mindspeed_hf.parallel.tensor', 'mindspeed_hf.parallel.expert',\n"
        "            'mindspeed_hf.parallel.context.model', 'mindspeed_hf.parallel.context.ring',\n"
        "            'mindspeed_hf.parallel.context.denoiser', 'mindspeed_hf.memory.offload']\n"
        "print('loaded', [m for m in optional if m in sys.modules])\n"
        "from mindspeed_hf.parallel import apply_expert_parallel, parallelize\n"
        "from mindspeed_hf import parallel\n"
        "print('expert', 'mindspeed_hf.parallel.expert' in sys.modules, callable(parallel.parallelize),\n"
        "      parallel.parallelize is parallelize)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=child_env(True), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "loaded []" in proc.stdout, proc.stdout
    assert "expert True True True" in proc.stdout, proc.stdout
