"""Shared test setup: import mindspeed_hf without patching (each test enables what it compares), put the
torch_npu stand-in on the path, and make sure no test leaves the package enabled."""

import os
import sys
from pathlib import Path

os.environ["MINDSPEED_HF_AUTO"] = "0"
os.environ.pop("MINDSPEED_HF_BACKEND", None)
os.environ.pop("MINDSPEED_HF_CONFIG", None)
# The suite checks our kernels against HF's, so on this CPU it runs ours everywhere: the `_our_kernels_on_cpu` fixture
# below in this process, kernels.torch_path: fused in child runs (child_runs.child_env). The default (auto: HF's code
# where ours is slower on the torch backend) is tested by the tests marked torch_path_auto
# (tests/models/test_torch_path.py) and by the CI's training run.
STANDIN = Path(__file__).parent / "npu_standin"
sys.path.insert(0, str(STANDIN))
# With the stand-in importable, DeepSpeed (imported by accelerate whenever it is installed) would pick its NPU
# accelerator, which needs a real torch.npu: these CPU tests (and their child runs) use its CPU accelerator.
os.environ["DS_ACCELERATOR"] = "cpu"

import logging  # noqa: E402

import pytest  # noqa: E402

import mindspeed_hf  # noqa: E402
from mindspeed_hf.ops import registry  # noqa: E402
from mindspeed_hf.patches import choice  # noqa: E402

logging.getLogger("mindspeed_hf").propagate = True  # let caplog see the package's records

# The long tests: multi-process runs under torchrun, whole example / recipe / benchmark runs, crash-and-resume
# loops, the fine-tuning frameworks. The README's quick command leaves them out (`-m "not slow"`); .ci/run runs all.
SLOW = ("distributed/", "frameworks/", "trainer/test_crash_resume.py", "trainer/test_examples.py",
        "trainer/test_vl_recipe.py", "trainer/test_qwen3_tts_example.py", "trainer/test_bench_cli.py",
        "trainer/test_bench_gpu_check.py", "trainer/test_bench_counts.py", "trainer/test_diffusion_recipe.py")
QUICK = ("distributed/test_context_split.py", "distributed/test_deepspeed_refusal.py",
         "distributed/test_parallel_dims.py")  # in distributed/, but single-process and short


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    for item in items:
        where = Path(str(item.fspath)).relative_to(root).as_posix()
        if where.startswith(SLOW) and not where.startswith(QUICK):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _restore_mindspeed():
    # The environment too: transformers 4.57's TrainingArguments(fsdp=...) writes ACCELERATE_USE_FSDP / FSDP_* into
    # os.environ, which later tests in this process would read as an `accelerate launch` request.
    environ = dict(os.environ)
    yield
    mindspeed_hf.disable()
    registry.set_backend(None)
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture(autouse=True)
def _our_kernels_on_cpu(request, monkeypatch):
    """Every config built in a test runs our kernels on the torch backend, as kernels.torch_path: fused would (the
    tests compare them with HF's); a test marked torch_path_auto gets the default choice instead."""
    if not request.node.get_closest_marker("torch_path_auto"):
        monkeypatch.setattr(choice, "on_torch_backend", lambda config: False)


@pytest.fixture(params=["torch", "npu"])
def backend(request):
    """Run a test on the torch reference and on the NPU path (through the stand-in torch_npu)."""
    registry.set_backend(request.param)
    yield request.param
    registry.set_backend(None)
