#!/usr/bin/env bash
# The fine-tuning frameworks' own command lines with `import mindspeed_hf` in a sitecustomize, against their plain
# runs (docs/frameworks.md). Builds the LLaMA-Factory 0.9.5 environment from scratch OUTSIDE the repository
# (default /tmp/mindspeed_fw/llamafactory, or $FW_ROOT/llamafactory), then runs tests/frameworks in it (and, when
# .ci/run exports RELEASE_TESTS, those first: transformers 5.6.0 is the release LLaMA-Factory 0.9.5 pins).
# Measured on the 2-core machine: install about 5 min (quiet machine), the tests about 4.5 min.
# FW_SWIFT=1 also builds ms-swift 4.6.0's environment and runs tests/frameworks/test_swift.py.
# FW_AXOLOTL=1 also builds axolotl 0.19.0's (the newest on Python 3.11; about 10 min) and runs test_axolotl.py.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
FW_ROOT=${FW_ROOT:-/tmp/mindspeed_fw}
ENV_DIR=$FW_ROOT/llamafactory
mkdir -p "$FW_ROOT"
start=$(date +%s)

rm -rf "$ENV_DIR"
python3 -m venv "$ENV_DIR"
# shellcheck disable=SC1091
source "$ENV_DIR/bin/activate"
python -m pip install -q torch==2.13.0                       # the CPU build from local disk: always first
# torchvision's newest release pins torch 2.14.1 (the resolver would replace torch with a CUDA build of gigabytes):
# hold torch and take the torchvision release made for it.
printf 'torch==2.13.0\ntorchvision==0.28.0\n' > "$FW_ROOT/constraints.txt"
PIP_CONSTRAINT="$FW_ROOT/constraints.txt" python -m pip install -q llamafactory==0.9.5 pytest
# `pip install -e` writes the egg-info into the checkout: one at a time when CI builds environments side by side
if [ -n "${FW_INSTALL_LOCK:-}" ]; then
    flock "$FW_INSTALL_LOCK" python -m pip install -q --no-deps -e "$REPO"
else
    python -m pip install -q --no-deps -e "$REPO"
fi
# torchvision 0.28.0 on PyPI is the CUDA build and torchaudio has no release for torch 2.13: neither loads against
# the CPU torch, and transformers / LLaMA-Factory import them when present. Text training needs neither:
# remove torchvision, and leave an empty stand-in for torchaudio (llamafactory.data.mm_plugin imports it at
# module import, for audio inputs only).
python -m pip uninstall -y -q torchvision torchaudio
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/torchaudio"
echo '"""Stand-in: torchaudio has no build for torch 2.13; LLaMA-Factory imports it for audio inputs only."""' \
    > "$site/torchaudio/__init__.py"
python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|peft|trl|datasets|llamafactory) '
echo "== install: $(( $(date +%s) - start )) s"

# The seam tests and training smoke (.ci/run's RELEASE_TESTS) on transformers 5.6.0 with LLaMA-Factory's own pins of
# accelerate, PEFT and TRL: the release its users run.
if [ -n "${RELEASE_TESTS:-}" ]; then
    release_start=$(date +%s)
    # shellcheck disable=SC2086
    python -m pytest -q -p no:cacheprovider --basetemp="$FW_ROOT/pytest-release" $RELEASE_TESTS
    echo "== release tests in LLaMA-Factory's environment: $(( $(date +%s) - release_start )) s"
fi
test_start=$(date +%s)
python -m pytest -q tests/frameworks -p no:cacheprovider --basetemp="$FW_ROOT/pytest-frameworks"
echo "== tests: $(( $(date +%s) - test_start )) s; total $(( $(date +%s) - start )) s"
deactivate

# ms-swift 4.6.0 (opt-in, FW_SWIFT=1: about 10 more minutes): its `swift sft` plain vs accelerated.
if [ "${FW_SWIFT:-0}" = "1" ]; then
    swift_start=$(date +%s)
    rm -rf "$FW_ROOT/swift"
    python3 -m venv "$FW_ROOT/swift"
    # shellcheck disable=SC1091
    source "$FW_ROOT/swift/bin/activate"
    python -m pip install -q torch==2.13.0
    PIP_CONSTRAINT="$FW_ROOT/constraints.txt" python -m pip install -q ms-swift==4.6.0 pytest
    python -m pip install -q --no-deps -e "$REPO"
    python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|peft|trl|ms-swift) '
    python -m pytest -q tests/frameworks/test_swift.py -p no:cacheprovider
    echo "== ms-swift: $(( $(date +%s) - swift_start )) s"
    deactivate
fi

# axolotl 0.19.0 (opt-in, FW_AXOLOTL=1: about 10 minutes of install, 5 of tests): `axolotl train` plain vs
# accelerated. 0.20 and later need Python >= 3.12; 0.19.0 pins transformers 5.16.1, trl 1.9.0, torch <= 2.13.0.
if [ "${FW_AXOLOTL:-0}" = "1" ]; then
    axolotl_start=$(date +%s)
    rm -rf "$FW_ROOT/axolotl"
    python3 -m venv "$FW_ROOT/axolotl"
    # shellcheck disable=SC1091
    source "$FW_ROOT/axolotl/bin/activate"
    python -m pip install -q torch==2.13.0
    PIP_CONSTRAINT="$FW_ROOT/constraints.txt" python -m pip install -q axolotl==0.19.0 pytest
    python -m pip install -q --no-deps -e "$REPO"
    python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|peft|trl|axolotl) '
    python -m pytest -q tests/frameworks/test_axolotl.py -p no:cacheprovider
    echo "== axolotl: $(( $(date +%s) - axolotl_start )) s"
    deactivate
fi
