#!/usr/bin/env bash
# The checks that need a CUDA device (skipped in CI, which has none): run them where one is available.
#   bash scripts/device_check.sh        # after scripts/setup.sh (or with batchpilot installed)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -f .venv/bin/activate ]; then
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi
python - <<'PY'
import torch
if not torch.cuda.is_available():
    raise SystemExit(f"device_check: no CUDA device visible to torch {torch.__version__} (a +cpu build sees none); "
                     "these checks need a CUDA build of torch and a GPU.")
print(f"device_check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
PY
exec python -m pytest -q -rs tests/test_cuda.py "tests/test_engine_stats.py::test_micro_timer_on_cuda_counts_the_queued_work_not_the_launches" "$@"
