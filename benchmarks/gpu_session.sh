#!/usr/bin/env bash
# The checks run in a session that is lent one GPU (CI never has one). One script, so one
# machine start covers them all; each step has its own time limit, and a failed step does
# not stop the next. Run from the repository root:
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh
#
# Needs python3 with a CUDA build of torch. Where Ray is not installed, wheels in .whl/
# (ray 2.60.0 for that Python, its jars left out, and the few dependencies the image lacks)
# are installed into /tmp/site first. How .whl/ was made for the lent machines' image
# (Python 3.12, torch 2.11.0+cu130; 49 MB, under the 64 MB a device call carries; 2026-11-28):
#   echo /.whl/ >> .git/info/exclude
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
#      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64"
#   pip download $P -d raw ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
#      referencing==0.37.0 rpds-py==2026.9.1 pydantic==2.14.4 pydantic_core==2.50.5
#      annotated-types==0.8.0 typing-inspection==0.4.5 tensorboardX==2.6.5 hjson==3.1.0
#   ray's wheel unpacked, ray/jars and ray/rllib deleted (and their RECORD lines), zipped
#   again under the same name (45 MB); the rest copied as they are
#   .venv/bin/pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8   (pure Python)
# and each device call names .whl in `carry`.
#   1. tests/gpu: the CUDA snapshot copy, NCCL training on every GPU through a Ray cluster, and
#      FSDP2 on the GPU persisted and resumed from storage like an uninterrupted run
#   2. benchmarks/gpu_snapshot.py: snapshot stall per step and restore on the 51.6M model
#   3. benchmarks/recovery.py --cuda: node loss and scale-up with the model on the GPU,
#      raylastic against Ray Train in the same run (FRAMEWORKS, default all three)
#   4. sharded (only when STEPS names it): benchmarks/sharded_recovery.py on the machine's
#      CPUs, the GPU hidden (CUDA_VISIBLE_DEVICES=""), SHARDED_CPUS (default 4) CPUs per
#      worker: the 51.6M FSDP2 / ZeRO-3 recovery where steps are not starved of cores.
#      DeepSpeed comes from .whl/ as pure Python (DS_ACCELERATOR=cpu, gloo collectives).
# STEPS picks the steps (default "gpu_tests gpu_snapshot recovery_cuda"). The limits keep
# the default steps inside one 10-minute device call.
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import ray" 2>/dev/null && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g | head -2;
  python3 -c "import sys, torch, ray; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'ray', ray.__version__, 'gpus', torch.cuda.device_count())"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout -k 30 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc in $((SECONDS - t0)) s"; tail -n 25 "$OUT/$name.log"; }
STEPS=${STEPS:-gpu_tests gpu_snapshot recovery_cuda}
on() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
on gpu_tests && step gpu_tests 200 python3 -m pytest -q -ra -p no:cacheprovider tests/gpu
on gpu_snapshot && step gpu_snapshot 90 python3 benchmarks/gpu_snapshot.py --out "$OUT/gpu_snapshot.json"
on recovery_cuda && step recovery_cuda ${RECOVERY_LIMIT_S:-300} python3 benchmarks/recovery.py --cuda --quick \
  --hidden 1536 --layers 5 --scenarios unannounced --frameworks ${FRAMEWORKS:-raylastic_state,raylastic,ray_train} \
  --out "$OUT/recovery_cuda.json"
on sharded && CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu step sharded ${SHARDED_LIMIT_S:-300} \
  python3 benchmarks/sharded_recovery.py --cpus-per-worker ${SHARDED_CPUS:-4} --kill-at 5 --between 2 \
  --checkpoint-every 3 --timeout-s 150 --systems ${SHARDED_SYSTEMS:-raylastic} \
  --frameworks ${SHARDED_FRAMEWORKS:-fsdp2,zero3} ${SHARDED_ARGS:-} --out "$OUT/sharded_recovery.json"
# The brackets keep the pattern from matching a shell whose command line holds it: the plain
# pattern once killed the device call's own shell, which had this script's steps inline.
pkill -9 -f "[r]aylet|[g]cs_server|[r]ay::" 2>/dev/null
exit 0
