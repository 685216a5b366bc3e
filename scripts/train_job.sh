#!/usr/bin/env bash
# Prepares a mazerl run and submits it to a running Ray cluster as a Ray job. Safe to run again.
#
#   scripts/train_job.sh [CONFIG] [key=value ...] [--address URL] [--dry-run | --prepare-only]
#
#   CONFIG           YAML config inside this repository, the job's working_dir (default configs/hyperpod.yaml);
#                    key=value overrides go to app.main too
#   --address URL    the Ray dashboard / job API (default $RAY_ADDRESS if it is http(s)://, else
#                    http://127.0.0.1:8265, e.g. through `kubectl port-forward svc/mazerl-head-svc 8265`)
#   --dry-run        validate and print every step; create nothing, contact no cluster
#   --prepare-only   validate, create the folders and eval_set.json, but submit nothing (before a RayJob)
#
# Steps:
#  1. `python -m app.main CONFIG --plan` validates the config, including that model.path and
#     model.adapter_init exist, and prints the plan. A config error stops here with exit code 2. So run this
#     where the config's paths are mounted: for configs/hyperpod.yaml that is /shared, e.g. the head pod
#     (`kubectl exec -it <head pod> -- scripts/train_job.sh configs/hyperpod.yaml`).
#  2. Creates the run folder, checkpoint.ckpt_path and checkpoint.export_dir (defaults under
#     <output_dir>/<run_name>), and writes <output_dir>/<run_name>/eval_set.json, the held-out eval set
#     (seeds and maze identities), if it is absent. An existing file is kept. If it no longer matches the
#     config, you get a warning.
#  3. Submits `python -m app.main CONFIG` with the submission id mazerl-<run_name>, which is stable per run.
#     Running the script again with the same run:
#       PENDING/RUNNING  attaches to the job's logs and submits nothing;
#       SUCCEEDED        says so and exits 0 (`ray job delete mazerl-<run_name>` to allow a new submission);
#       FAILED/STOPPED   saves the old job's logs to <run dir>/ray-job-<time>.log, deletes the old job
#                        record (Ray ids are unique per cluster), and submits again. The new driver resumes
#                        from the newest complete checkpoint (checkpoint.resume_mode: latest).
#     Ctrl-C while following logs detaches; the job keeps running (`ray job stop mazerl-<run_name>`).
#
# Token auth (Ray 2.60's default): the client needs the cluster's token in RAY_AUTH_TOKEN (or
# ~/.ray/auth_token) and RAY_AUTH_MODE=token; docs/OPERATING.md shows how to read it from the Secret.
# S3 credentials are never passed here: every node takes them from the AWS default chain.
# Environment: PYTHON (default .venv/bin/python if present, else python), RAY_CLI (default ray).
set -euo pipefail
CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)

usage() { sed -n '2,/^set -euo/p' "$ROOT/scripts/train_job.sh" | sed '$d' | sed 's/^# \{0,1\}//'; }
show() {  # prints a command so that it can be pasted into a shell
  local out="" a
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then out+="$a "; else out+="'${a//\'/\'\\\'\'}' "; fi
  done
  printf '   %s\n' "${out% }"
}

CONFIG=""
ADDRESS=""
MODE=submit
OVERRIDES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --address) [ $# -ge 2 ] || { echo "train_job.sh: --address needs a URL" >&2; exit 2; }; ADDRESS=$2; shift 2 ;;
    --address=*) ADDRESS=${1#--address=}; shift ;;
    --dry-run) MODE=dry-run; shift ;;
    --prepare-only) MODE=prepare; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "train_job.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *=*) OVERRIDES+=("$1"); shift ;;
    *) [ -z "$CONFIG" ] || { echo "train_job.sh: a second config '$1' (one CONFIG only)" >&2; exit 2; }
       CONFIG=$1; shift ;;
  esac
done
# The job runs `python -m app.main CONFIG` in the uploaded copy of this folder (--working-dir .), so CONFIG
# must lie inside it; it is passed on relative to it. A CONFIG given here is relative to the caller's folder.
if [ -n "$CONFIG" ]; then
  case $CONFIG in /*) ABS=$CONFIG ;; *) ABS=$CALLER_DIR/$CONFIG ;; esac
  [ -f "$ABS" ] || { echo "train_job.sh: config $CONFIG does not exist (or is not a file)" >&2; exit 2; }
  ABS=$(cd "$(dirname "$ABS")" && pwd -P)/$(basename "$ABS")
  case $ABS in
    "$ROOT"/*) CONFIG=${ABS#"$ROOT"/} ;;
    *) echo "train_job.sh: config $CONFIG is outside $ROOT; the job only sees that folder (its working_dir)," \
            "so copy the config under $ROOT/configs/" >&2; exit 2 ;;
  esac
fi
CONFIG=${CONFIG:-configs/hyperpod.yaml}
if [ -z "$ADDRESS" ]; then
  case "${RAY_ADDRESS:-}" in http://*|https://*) ADDRESS=$RAY_ADDRESS ;; *) ADDRESS=http://127.0.0.1:8265 ;; esac
fi
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python; fi
RAY=${RAY_CLI:-ray}
[ "$MODE" = dry-run ] && DRY="(dry run) " || DRY=""

# 1. validate: the config, its paths, the placement plan
echo "== ${DRY}checking $CONFIG: $PY -m app.main $CONFIG ${OVERRIDES[*]} --plan"
if ! PLAN=$("$PY" -m app.main "$CONFIG" "${OVERRIDES[@]}" --plan); then
  echo "train_job.sh: the config check failed (above); nothing was created or submitted" >&2
  exit 2
fi
printf '%s\n' "$PLAN" | sed -n '/^placement group:/,$p'

# 2. prepare the run's folders and the eval set description; prints shell assignments for step 3
echo "== ${DRY}preparing the run folders"
PREP=$("$PY" - "$MODE" "$CONFIG" "${OVERRIDES[@]}" <<'PYEOF'
import json, os, shlex, sys, tempfile
from pathlib import Path

from app.config import absolute_paths, load_config
from app.world.maze import solvable_count
from app.world.sampler import eval_mazes

mode, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
dry = mode == "dry-run"
raw = load_config(config, overrides)
cfg = absolute_paths(raw)
relative = [f"{name}={value}" for name, value in (("output_dir", raw.output_dir),
            ("checkpoint.ckpt_path", raw.checkpoint.ckpt_path), ("checkpoint.export_dir", raw.checkpoint.export_dir))
            if value and not os.path.isabs(value)]
if relative:
    print(f"   WARNING: {', '.join(relative)} is relative. The job resolves it in its own working folder (Ray's copy "
          f"of this one), not here: the job's files will not be the ones below. Use absolute paths on the shared "
          f"volume for a cluster run.", file=sys.stderr)
run_dir = Path(cfg.output_dir) / cfg.run_name
ck = cfg.checkpoint

def say(text):
    print(text, file=sys.stderr)

for folder in (run_dir, Path(ck.ckpt_path), Path(ck.export_dir)):
    if folder.is_dir():
        say(f"   exists      {folder}")
    elif dry:
        say(f"   would create {folder}")
    else:
        folder.mkdir(parents=True, exist_ok=True)
        say(f"   created     {folder}")

mazes = eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)
max_turns = cfg.rollout.max_turns
eval_set = {
    "run_name": cfg.run_name,
    "what": "the held-out evaluation mazes of this run: seeds eval.seed .. eval.seed+num_mazes-1; identity is "
            "app.world.maze.Maze.identity (sha256 of layout, start and goal); the training sampler skips these identities",
    "maze_size": cfg.maze.size,
    "max_turns": max_turns,
    "first_seed": cfg.eval.seed,
    "num_mazes": len(mazes),
    "solvable_within_max_turns": solvable_count(mazes, max_turns),
    "mazes": [{"seed": m.seed, "identity": m.identity, "start": list(m.start), "goal": list(m.goal),
               "shortest_path_moves": m.shortest_path_length, "solvable": m.solvable_within(max_turns)}
              for m in mazes],
}
path = run_dir / "eval_set.json"
if path.is_file():
    try:
        old = json.loads(path.read_text())
        same = [(m["seed"], m["identity"]) for m in old["mazes"]] == [(m["seed"], m["identity"]) for m in eval_set["mazes"]]
    except (ValueError, KeyError, TypeError):
        same = False
    say(f"   exists      {path}" + ("" if same else
        "  WARNING: it does not match this config's eval set (eval.seed, eval.num_mazes, maze.size changed?); "
        "kept as it is. Delete it to write the current one."))
elif dry:
    say(f"   would write {path} ({len(mazes)} mazes, {eval_set['solvable_within_max_turns']} solvable "
        f"within {max_turns} turns)")
else:
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".eval_set.", suffix=".json")
    head = json.dumps({k: v for k, v in eval_set.items() if k != "mazes"}, indent=1)[:-2]
    with os.fdopen(fd, "w") as f:  # one maze per line
        f.write(head + ',\n "mazes": [\n' + ",\n".join("  " + json.dumps(m) for m in eval_set["mazes"]) + "\n ]\n}\n")
    os.replace(tmp, path)
    say(f"   wrote       {path} ({len(mazes)} mazes, {eval_set['solvable_within_max_turns']} solvable "
        f"within {max_turns} turns)")

print(f"RUN_NAME={shlex.quote(cfg.run_name)}")
print(f"RUN_DIR={shlex.quote(str(run_dir))}")
PYEOF
)
eval "$PREP"

# 3. submit (or attach)
SUBMISSION_ID="mazerl-${RUN_NAME}"
# Job-level env vars. Never HF_HUB_OFFLINE or TOKENIZERS_PARALLELISM: the driver sets those in its own
# ray.init runtime_env, and Ray refuses to merge a job runtime_env that sets the same keys.
RUNTIME_ENV='{"env_vars": {"VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONUNBUFFERED": "1"}, "excludes": [".git", ".venv", "runs", "outputs", ".gpu-wheels", "__pycache__"]}'
SUBMIT=("$RAY" job submit --address "$ADDRESS" --submission-id "$SUBMISSION_ID" --no-wait
        --working-dir . --runtime-env-json "$RUNTIME_ENV" -- python -m app.main "$CONFIG" "${OVERRIDES[@]}")
FOLLOW=("$RAY" job logs --address "$ADDRESS" --follow "$SUBMISSION_ID")

if [ "$MODE" = prepare ]; then
  echo "== prepared $RUN_DIR; not submitted (--prepare-only)"
  exit 0
fi
if [ "$MODE" = dry-run ]; then
  echo "== (dry run) would look up job $SUBMISSION_ID at $ADDRESS:"
  echo "   PENDING/RUNNING: attach; SUCCEEDED: stop; FAILED/STOPPED: save its logs, delete it, submit; absent: submit"
  echo "== (dry run) would submit:"
  show "${SUBMIT[@]}"
  echo "== (dry run) would follow:"
  show "${FOLLOW[@]}"
  exit 0
fi

STATUS=$("$PY" - "$ADDRESS" "$SUBMISSION_ID" <<'PYEOF'
import sys
from ray.job_submission import JobSubmissionClient

address, job_id = sys.argv[1], sys.argv[2]
try:
    client = JobSubmissionClient(address)
except Exception as e:  # unreachable, or 401 without the token
    sys.exit(f"train_job.sh: cannot reach the Ray job API at {address}: {e}. With token auth, set "
             "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (docs/OPERATING.md).")
try:
    print(client.get_job_status(job_id).value)
except RuntimeError as e:
    if "404" in str(e) or "does not exist" in str(e):
        print("ABSENT")
    else:
        sys.exit(f"train_job.sh: cannot read the status of job {job_id}: {e}")
PYEOF
)
echo "== job $SUBMISSION_ID at $ADDRESS: $STATUS"
case "$STATUS" in
  PENDING|RUNNING)
    echo "== attaching (Ctrl-C detaches; the job keeps running)"
    exec "${FOLLOW[@]}" ;;
  SUCCEEDED)
    echo "== $SUBMISSION_ID already succeeded; nothing to do (ray job delete --address $ADDRESS $SUBMISSION_ID to allow a new one)"
    exit 0 ;;
  FAILED|STOPPED)
    LOG="$RUN_DIR/ray-job-$(date -u +%Y%m%dT%H%M%SZ).log"
    "$RAY" job logs --address "$ADDRESS" "$SUBMISSION_ID" > "$LOG" 2>&1 || true
    echo "== saved the previous attempt's logs to $LOG; deleting its job record, then resubmitting (resumes from the latest checkpoint)"
    "$RAY" job delete --address "$ADDRESS" "$SUBMISSION_ID" ;;
  ABSENT) ;;
  *) echo "train_job.sh: unexpected job status '$STATUS'" >&2; exit 1 ;;
esac
echo "== submitting $SUBMISSION_ID"
"${SUBMIT[@]}"
exec "${FOLLOW[@]}"
