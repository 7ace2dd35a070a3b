#!/bin/bash
# Device-side launcher for the H200 learning-budget run (docs/results.md, "H200 with learning
# budgets"). The first call installs the carried wheels and starts the bench in its own session
# (it outlives the call while the machine stays warm); every call waits up to $1 s and copies
# the JSON so far, the log (and the kept logs of a failed run) to $OUT. Through the device tool,
# from the repo root, with `.whl` carried (the wheels docs/results.md lists, msgspec among them):
#   SEED=2 bash bench/h200_multitenant.sh 540
# then the same call again, back to back (the machine stays warm 30 s), until "bench finished".
WAIT=${1:-540}
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -3
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH OMP_NUM_THREADS=2 PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/gpu
if [ ! -f /tmp/gpu/started ]; then
  nproc; nvidia-smi -L; date > /tmp/gpu/started
  cp -r . /tmp/gpu/repo
  cd /tmp/gpu/repo && setsid nohup env NEXUS_TRAINER_FAST=1 NEXUS_INFER_COMPILE=0 NEXUS_TENSORBOARD=0 \
    python3 -m bench.multitenant --mix rl-reach:1000,rl-reach-easy:1000,rl-reach-top:1000,sft-reach:600 \
    --sft-demos 300 --sft-eval-episodes 20 --rl-steps-per-update 512 --rl-parallel-envs 8 --rl-epochs 2 \
    --maniskill off --poll-s 2 --run-timeout-s 1200 --seed ${SEED:-1} $EXTRA --out /tmp/gpu/mt_h200_learn_s${SEED:-1}.json \
    > /tmp/gpu/mt.log 2>&1 < /dev/null &
  cd - >/dev/null
fi
t0=$(date +%s)
while [ $(( $(date +%s) - t0 )) -lt $WAIT ]; do
  pgrep -f "bench.multitenant" >/dev/null || { echo "bench finished"; break; }
  sleep 5
done
cp /tmp/gpu/mt_h200_learn_s${SEED:-1}.json /tmp/gpu/mt.log $OUT/ 2>/dev/null
cp /tmp/gpu/mt_h200_learn_s${SEED:-1}.png $OUT/ 2>/dev/null
d=$(grep -o "logs kept in [^ ]*" /tmp/gpu/mt.log | tail -1 | awk '{print $4}')
[ -n "$d" ] && tar czf $OUT/kept_logs.tgz -C "$d" . 2>/dev/null
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
grep -v "running v" /tmp/gpu/mt.log | tail -30
