#!/usr/bin/env bash
# Run transformers' own tests with the accelerator on (MINDSPEED_HF_AUTO=0 in the environment: without it).
# Usage: tests/hf_own/run_hf_tests.sh HF_ROOT [pytest arguments...]
#   HF_ROOT: a checkout of the transformers repository matching the installed wheel (its tests/ and conftest.py),
#            kept outside this repository; the tests are run from there, never copied here.
# Example:
#   tests/hf_own/run_hf_tests.sh /tmp/hf_tests tests/models/qwen3/test_modeling_qwen3.py \
#       -k "test_generate_compile_model_forward_fullgraph or test_static_cache_no_recompile_with_smaller_length"
# HF_OWN_COMPILE_BACKEND=aot_eager: transformers' CompileConfig defaults to aot_eager (see the plugin).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="${1:?usage: run_hf_tests.sh HF_ROOT [pytest arguments...]}"
shift
cd "$root"
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec python -m pytest -p mindspeed_hf_on -p no:cacheprovider "$@"
