#!/usr/bin/env bash
# CI's LLaMA-Factory leg (docs/TRAINERS.md, "LLaMA-Factory"): `pip install llamafactory` as a user runs it, in a venv of
# its own (.venv-llamafactory), so that pip resolves LLaMA-Factory's pins (peft 0.18.x, transformers <= 5.6, trl <= 0.24
# for 0.9.5) and not the test extra's newer ones; dorafp8 installed editable beside them without its dependencies (it
# needs only torch and numpy, which LLaMA-Factory brings). Then, with that peft, in two processes (pytest-xdist, whole
# files each):
#   - tests/integration/test_trainers.py's LLaMA-Factory test: `dorafp8 run --quantize -- llamafactory-cli train`
#     against plain LLaMA-Factory on the dequantized checkpoint, LLaMA-Factory's own version check on;
#   - tests/peft/test_peft.py: dorafp8's PEFT layers against PEFT's own DoRA, built by get_peft_model and converted,
#     merged, saved and loaded;
#   - tests/integration/test_llamafactory_multi.py: LLaMA-Factory's own ZeRO-3 and FSDP2 config files through the
#     launcher, 2 CPU processes over gloo, against one process (3.7 minutes on 2 busy cores). It needs deepspeed, which
#     LLaMA-Factory's ZeRO configs need and its package does not install; DeepSpeed compiles its CPU shared-memory op
#     on first use (a C++ compiler; cached in ~/.cache/torch_extensions, as for tests/distributed/test_loading.py).
# None may skip. The venv (about 6.5 GB) is deleted when the tests have run; the pytest log is kept as
# .venv-llamafactory.log.
#
#   bash .ci/llamafactory.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
venv=.venv-llamafactory
t0=$(date +%s)
rm -rf "$venv"
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
# wheel and setuptools>=77: dorafp8's editable install without build isolation (as in .ci/version_matrix.sh)
"$venv/bin/pip" install -q llamafactory deepspeed pytest pytest-xdist wheel "setuptools>=77" 2>&1 \
    | { grep -v "is ignored: it is neither" || true; }
DORAFP8_SKIP_CUDA_BUILD=1 "$venv/bin/pip" install -q -e . --no-deps --no-build-isolation
"$venv/bin/python" -c "import importlib.metadata as m
dists = ('llamafactory', 'peft', 'transformers', 'accelerate', 'deepspeed', 'torch')
print('== llamafactory leg:', ', '.join(f'{d} {m.version(d)}' for d in dists))"
t1=$(date +%s)
echo "== llamafactory leg: installed in $((t1 - t0))s"
"$venv/bin/python" -m pytest \
    tests/integration/test_trainers.py::test_llamafactory_cli_through_the_launcher_matches_peft_on_dequantized_weights \
    tests/peft/test_peft.py tests/integration/test_llamafactory_multi.py \
    -q -n 2 --dist loadfile -p no:cacheprovider -rsx 2>&1 | tee "$venv.log"
summary=$(tail -n 1 "$venv.log")
if [[ "$summary" == *skipped* || "$summary" != *passed* ]]; then
    echo "llamafactory leg: $summary: every test must run and pass here"
    exit 1
fi
echo "== llamafactory leg: tests in $(( $(date +%s) - t1 ))s"
