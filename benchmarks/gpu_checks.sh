#!/usr/bin/env bash
# The checks no CPU can do, as one script for a machine with at least one CUDA GPU.
#
#   bash benchmarks/gpu_checks.sh [RESULTS_DIR]      # default: build/gpu_checks
#
# Each check runs scripts/train_ddp.py for a few steps and keeps its metrics and log, so the
# figures can be copied into docs/gpu_results.md with the date and the hardware.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-build/gpu_checks}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/hardware.txt" 2>&1
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" >> "$OUT/hardware.txt"

run() {  # name, nproc, train_ddp.py arguments...
  local name=$1 nproc=$2; shift 2
  echo "== $name"
  timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$nproc" \
    scripts/train_ddp.py --dataset synthetic --model resnet18 --max-steps 60 --epochs 1 \
    --batch-size 128 --log-every 10 --progress off --metrics-out "$OUT/$name.jsonl" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "   exit $? ; last line: $(tail -n 1 "$OUT/$name.log")"
}

run fp32_nccl_1rank 1 --precision fp32
run bf16_nccl_1rank 1 --precision bf16
run fp16_nccl_1rank 1 --precision fp16                        # with torch.amp.GradScaler
run sync_bn_1rank   1 --precision bf16 --sync-bn
run gloo_2ranks_1gpu 2 --backend gloo                          # two ranks sharing one GPU
"$PY" - "$OUT" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("*.jsonl")):
    recs = [json.loads(l) for l in f.read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"][1:]  # first window holds warm-up
    sps = statistics.median(r["samples_per_s"] for r in train) if train else float("nan")
    last = train[-1]["loss"] if train else float("nan")
    print(f"{f.stem:18s} median {sps:9.0f} samples/s   last loss {last:.4f}")
PY
