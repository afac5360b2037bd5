"""Configuration and device detection: bad input fails before any work with a message naming the setting and
the valid choices; a torch_npu that cannot load is survived with one warning."""

import importlib
import logging

import pytest

from mindspeed_hf import device
from mindspeed_hf.config import config_from_dict, load_config
from mindspeed_hf.ops import registry


@pytest.mark.parametrize("data,message", [
    ({"kernel": {}}, "unknown config key kernel (did you mean kernels?); valid config keys: backend, kernels"),
    ({"kernels": {"rmsnorm": True}}, "unknown config key kernels.rmsnorm (did you mean kernels.rms_norm?); valid "
                                     "config keys: kernels.rms_norm, kernels.rope"),
    ({"kernels": {"rope": "yes"}}, "kernels.rope='yes' must be true or false"),
    ({"parallel": {"dp_shard": 0}}, "parallel.dp_shard=0 must be >= 1, or -1"),
    ({"parallel": {"cp": 1.5}}, "parallel.cp=1.5 must be an integer"),
    ({"backend": "gpu"}, "backend='gpu' is not valid; choose one of auto, torch, npu, cuda"),
    ({"memory": [1]}, "section 'memory' must be a mapping of recompute"),
])
def test_bad_config_names_setting_and_choices(data, message):
    with pytest.raises(ValueError) as err:
        config_from_dict(data)
    assert message in str(err.value)


def test_config_file_and_env(tmp_path, monkeypatch):
    path = tmp_path / "ms.yaml"
    path.write_text("kernels: {swiglu: false, loss_chunk_size: 256}\nparallel: {dp_replicate: 2}\n")
    monkeypatch.setenv("MINDSPEED_HF_CONFIG", str(path))
    config = load_config()
    assert (config.kernels.swiglu, config.kernels.loss_chunk_size, config.parallel.dp_replicate) == (False, 256, 2)
    monkeypatch.setenv("MINDSPEED_HF_BACKEND", "torch")
    assert load_config().backend == "torch"
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_backend_env_is_validated(monkeypatch):
    monkeypatch.setenv("MINDSPEED_HF_BACKEND", "tpu")
    registry.set_backend(None)
    with pytest.raises(ValueError, match="MINDSPEED_HF_BACKEND='tpu' is not valid; choose one of auto, torch, npu"):
        registry.resolve_backend("cpu")


def test_auto_backend_follows_the_device():
    registry.set_backend("auto")
    # ("npu" device strings exist only once the real torch_npu has registered the device type)
    assert [registry.resolve_backend(d) for d in ("cpu", "cuda", "meta")] == ["torch", "cuda", "torch"]


@pytest.mark.parametrize("error", [OSError("libascendcl.so: cannot open shared object file"),
                                   ImportError("torch_npu refuses a CUDA build of torch")])
def test_broken_torch_npu_is_survived_with_one_warning(monkeypatch, caplog, error):
    real_import = importlib.import_module

    def fake_import(name, *args):
        if name == "torch_npu":
            raise error
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    device.import_torch_npu.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="mindspeed_hf"):
            assert device.import_torch_npu() is None
            assert device.import_torch_npu() is None
            assert not device.npu_available()
        assert device.detect_device_type() == "cpu"
        assert sum("cannot be loaded" in r.getMessage() for r in caplog.records) == 1
    finally:
        device.import_torch_npu.cache_clear()


def test_standin_torch_npu_alone_is_not_an_npu():
    """torch_npu importable but no torch.npu device: the device is not an NPU (auto stays on torch)."""
    assert device.import_torch_npu() is not None  # the stand-in, on the path in tests
    assert not device.npu_available()
    assert device.dist_backend("npu") == "hccl"
    with pytest.raises(ValueError, match="valid choices"):
        device.dist_backend("tpu")


def test_outside_the_supported_versions_import_warns_and_stays_off():
    """An unsupported transformers: `import mindspeed_hf` warns once and patches nothing; enable() says why."""
    import subprocess
    import sys

    from child_runs import child_env

    script = ("import importlib.metadata as m\n"
              "real = m.version\n"
              "m.version = lambda p: '4.40.0' if p == 'transformers' else real(p)\n"
              "import transformers\n"  # read from the imported package where it is (supported.installed)
              "transformers.__version__ = '4.40.0'\n"
              "import mindspeed_hf\n"
              "print('enabled', mindspeed_hf.is_enabled())\n"
              "try:\n"
              "    mindspeed_hf.enable()\n"
              "except RuntimeError as err:\n"
              "    print('refused', err)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=child_env(True, quiet=False), capture_output=True,
                          text=True, timeout=300)
    assert "enabled False" in proc.stdout, proc.stderr[-2000:]
    assert proc.stderr.count("transformers 4.40.0 (supported: >=4.57,<6) is outside the supported range") == 1
    assert "refused mindspeed_hf: transformers 4.40.0 (supported: >=4.57,<6)" in proc.stdout


def test_supported_ranges_match_the_package_metadata():
    from pathlib import Path

    from mindspeed_hf.releases import supported

    setup = (Path(__file__).parents[1] / "setup.cfg").read_text()
    for package, (low, high) in supported.SUPPORTED.items():
        assert f"{package}>={low},<{high}" in setup
    assert supported.unsupported() == []


def test_installed_release_is_the_metadata_one_imported_or_not():
    """supported.installed reads an imported package's __version__: the same release its metadata gives."""
    from importlib import metadata

    from packaging.version import Version

    from mindspeed_hf.releases import supported

    for package in supported.SUPPORTED:
        try:
            expected = Version(metadata.version(package))
        except metadata.PackageNotFoundError:
            assert supported.installed(package) is None
            continue
        __import__(package)
        assert supported.installed(package) == expected
