#!/usr/bin/env bash
# Install the blink_horovod development environment into .venv/ at the repo root.
#
#   1. system packages (compiler, cmake, patch, Open MPI)   -- apt, only if missing
#   2. .venv/ with Python 3.11                              -- only if missing
#   3. requirements.txt (pinned; torch is the local CPU build)
#   4. horovod 0.28.1 built from the sdist with patches/horovod-0.28.1.patch
#      (PyTorch + TensorFlow, Gloo + MPI) by scripts/build_horovod.sh -- skipped if already built
#   5. loud verification of the horovod build
#   6. `pip install -e .` of this project
#
# Idempotent: re-running it after a completed install takes a few seconds
# (a stamp in .venv/ records what was installed; horovod is re-verified every time).
#
# Environment:
#   BLINK_SKIP_HOROVOD=1   skip steps 4-5 (quick dev env without horovod)
#   BLINK_BUILD_JOBS=N     parallel compile jobs for horovod (default 2)
#   BLINK_PYTHON=path      interpreter for the venv (default python3.11)
#   BLINK_FORCE=1          ignore stamps: re-run pip and rebuild horovod
#   BLINK_GPU=1            GPU servers (docker/Dockerfile): accept a CUDA torch and build horovod
#                          with HOROVOD_GPU_OPERATIONS=NCCL (needs the CUDA toolkit and NCCL)
#   BLINK_HOROVOD_GPU=m    with BLINK_GPU=1: nccl (default) or cuda (no GPU operations; ranks may
#                          share a GPU); see `bash scripts/build_horovod.sh --help`
#   BLINK_CARRY=dir        offline: take the horovod sdist (and wheels) from dir (scripts/gpu_carry.sh)
#   BLINK_REQUIREMENTS=f   requirements file instead of requirements.txt (docker/requirements-gpu.txt)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

HVD_VERSION=0.28.1
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
BUILD="$ROOT/.build"
REQ="${BLINK_REQUIREMENTS:-$ROOT/requirements.txt}"
GPU="${BLINK_GPU:-0}"
PATCH="$ROOT/patches/horovod-$HVD_VERSION.patch"
STAMP="$VENV/.blink-install.stamp"          # whole install completed
REQ_STAMP="$VENV/.blink-requirements.sha256" # requirements.txt that was installed
HVD_STAMP="$VENV/.blink-horovod.sha256"      # patch + version horovod was built with
DEV_STAMP="$VENV/.blink-editable.sha256"     # setup.py that was installed with -e
APT_PKGS=(build-essential cmake patch libopenmpi-dev openmpi-bin)
SKIP_HVD="${BLINK_SKIP_HOROVOD:-0}"
JOBS="${BLINK_BUILD_JOBS:-2}"
FORCE="${BLINK_FORCE:-0}"
NSTEPS=6

T0=$SECONDS
log()  { printf '[install %4ds] %s\n' "$((SECONDS - T0))" "$*"; }
step() { local n=$1; shift; printf '[install %4ds] step %s/%s: %s\n' "$((SECONDS - T0))" "$n" "$NSTEPS" "$*"; }
die()  {
    printf '\n[install] ERROR: %s\n' "$*" >&2
    printf '[install] install FAILED after %ds\n' "$((SECONDS - T0))" >&2
    exit 1
}
# shellcheck disable=SC2154  # rc is assigned inside the trap
trap 'rc=$?; printf "\n[install] ERROR: command failed (exit %s) at %s:%s: %s\n[install] install FAILED after %ds\n" "$rc" "${BASH_SOURCE[0]}" "$LINENO" "$BASH_COMMAND" "$((SECONDS - T0))" >&2' ERR

sha() { sha256sum "$@" | awk '{print $1}' | sha256sum | awk '{print $1}'; }
stamp_is() { [ "$FORCE" != 1 ] && [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

[ -f "$REQ" ] || die "missing $REQ"
[ -f "$PATCH" ] || die "missing $PATCH"
[ -f "$ROOT/setup.py" ] || [ -f "$ROOT/pyproject.toml" ] || die "no setup.py / pyproject.toml at $ROOT"

SITE_HASH="$(sha "$REQ" "$PATCH" "$ROOT/setup.py" 2>/dev/null || sha "$REQ" "$PATCH")"
HVD_HASH="horovod==$HVD_VERSION $(sha "$PATCH")"

# ---------------------------------------------------------------------------
step 1 "system packages (${APT_PKGS[*]})"
missing=()
if command -v dpkg-query >/dev/null 2>&1; then
    for p in "${APT_PKGS[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
else
    # not Debian: accept the tools if they are on PATH
    for c in g++ make cmake patch mpicxx mpirun; do
        command -v "$c" >/dev/null 2>&1 || missing+=("$c")
    done
    [ ${#missing[@]} -eq 0 ] || die "no dpkg/apt here and missing tools: ${missing[*]}; install them by hand"
fi
if [ ${#missing[@]} -eq 0 ]; then
    log "  all present, skipping apt"
else
    log "  missing: ${missing[*]} -> apt-get install (takes ~10-60 s)"
    SUDO=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 || die "not root and no sudo: install ${missing[*]} by hand"
        SUDO=(sudo)
    fi
    mkdir -p "$BUILD"
    APT_LOG="$BUILD/apt.log"
    { "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q \
        && "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
        >"$APT_LOG" 2>&1 \
        || { tail -n 40 "$APT_LOG" >&2; die "apt-get install ${missing[*]} failed (log: $APT_LOG)"; }
    log "  apt done (log: ${APT_LOG#"$ROOT"/})"
fi

# ---------------------------------------------------------------------------
step 2 "virtual environment $VENV"
if [ -x "$PY" ] && "$PY" -c 'import sys' >/dev/null 2>&1; then
    log "  exists ($("$PY" -V 2>&1))"
else
    BASE_PY="${BLINK_PYTHON:-}"
    if [ -z "$BASE_PY" ]; then
        if command -v python3.11 >/dev/null 2>&1; then
            BASE_PY=python3.11
        elif command -v python3 >/dev/null 2>&1 && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
            BASE_PY=python3
        else
            die "python3.11 not found (set BLINK_PYTHON=/path/to/python3.11)"
        fi
    fi
    [ -e "$VENV" ] && { log "  $VENV is broken, recreating"; rm -rf "$VENV"; }
    "$BASE_PY" -m venv "$VENV" || die "could not create venv with $BASE_PY (Debian: apt-get install python3.11-venv)"
    rm -f "$STAMP" "$REQ_STAMP" "$HVD_STAMP" "$DEV_STAMP"
    log "  created with $("$PY" -V 2>&1)"
fi
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "$PY is $("$PY" -V 2>&1), need Python 3.11 (rm -rf .venv and re-run)"

# Fast path: a completed install with the same inputs.
if stamp_is "$STAMP" "$SITE_HASH horovod=built" \
   || { [ "$SKIP_HVD" = 1 ] && stamp_is "$STAMP" "$SITE_HASH horovod=skipped"; }; then
    FAST=1
else
    FAST=0
fi

# ---------------------------------------------------------------------------
step 3 "pip install -r requirements.txt (cold: ~70 s, TensorFlow is a 572 MB download)"
REQ_HASH="$(sha "$REQ")"
if stamp_is "$REQ_STAMP" "$REQ_HASH"; then
    log "  requirements already installed (stamp matches), skipping pip"
else
    rm -f "$STAMP"
    # (the grep drops pip's harmless notes about this machine's file:// extra indexes)
    "$PY" -m pip install --quiet --progress-bar off -r "$REQ" 2>&1 \
        | { grep -v "^WARNING: Location 'file://.*' is ignored" || true; } \
        || die "pip install -r requirements.txt failed"
    echo "$REQ_HASH" >"$REQ_STAMP"
    log "  requirements installed"
fi
# A CUDA torch would make horovod attempt a GPU build (fails here: no CUDA toolkit).
[ "$FAST" = 1 ] || [ "$GPU" = 1 ] || "$PY" - <<'EOF' || die "torch in .venv is not the pinned CPU build (see requirements.txt)"
import torch, sys
v = torch.__version__
if torch.version.cuda is not None:
    sys.exit(f"torch {v} is a CUDA build (cuda {torch.version.cuda}); expected the local CPU build 2.13.0+cpu")
print(f"[install]   torch {v} (CPU build)")
EOF

# ---------------------------------------------------------------------------
# Quick check (no framework import): horovod installed, with the version we want,
# a real metadata.json and the compiled framework libraries present.
horovod_files_ok() {
    "$PY" - "$HVD_VERSION" <<'EOF'
import importlib.util, json, os, sys, glob
spec = importlib.util.find_spec("horovod")
if spec is None or not spec.submodule_search_locations:
    sys.exit("horovod is not installed")
d = spec.submodule_search_locations[0]
meta_path = os.path.join(d, "metadata.json")
try:
    meta = json.load(open(meta_path))
except Exception as e:
    sys.exit(f"cannot read {meta_path}: {e}")
# A real build records the framework versions it compiled against, e.g.
# {"tensorflow": "2.21.0", "pytorch": "2.13.0+cpu", "dummy": "none"};
# a framework-less build (plain `pip install horovod`) is just {"dummy": "none"}.
missing = [k for k in ("pytorch", "tensorflow") if meta.get(k) in (None, "", "none")]
if missing:
    sys.exit(f"{meta_path} does not list {missing}: {meta}")
for sub in ("torch", "tensorflow"):
    if not glob.glob(os.path.join(d, sub, "mpi_lib*.so")):
        sys.exit(f"horovod/{sub} has no compiled mpi_lib*.so")
from importlib.metadata import version
if version("horovod") != sys.argv[1]:
    sys.exit(f"horovod {version('horovod')} installed, want {sys.argv[1]}")
EOF
}

# Full check: imports horovod.torch (and horovod.tensorflow when $1 = full).
verify_horovod() {
    TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}" "$PY" - "${1:-quick}" <<'EOF'
import importlib.util, json, os, sys
mode = sys.argv[1]
spec = importlib.util.find_spec("horovod")
if spec is None:
    sys.exit("horovod is not installed in .venv")
meta_path = os.path.join(spec.submodule_search_locations[0], "metadata.json")
meta = json.load(open(meta_path))
print(f"[install]   {meta_path}: {json.dumps(meta)}")
missing = [k for k in ("pytorch", "tensorflow") if meta.get(k) in (None, "", "none")]
if missing:
    sys.exit(f"metadata.json does not list {missing}: horovod was built WITHOUT those "
             "frameworks (a plain `pip install horovod` builds none of them)")
import horovod.torch as hvd
gloo, mpi = hvd.gloo_built(), hvd.mpi_built()
print(f"[install]   horovod.torch: gloo_built()={gloo} mpi_built()={mpi} "
      f"nccl_built()={hvd.nccl_built()} cuda_built()={hvd.cuda_built()}")
if not (gloo and mpi):
    sys.exit("horovod.torch lacks Gloo and/or MPI support")
if not callable(getattr(hvd, "init", None)):
    sys.exit("horovod.torch has no init(): the extension was not built")
if mode == "full":
    import horovod.tensorflow as hvd_tf
    print(f"[install]   horovod.tensorflow: gloo_built()={hvd_tf.gloo_built()} mpi_built()={hvd_tf.mpi_built()}")
    if not (hvd_tf.gloo_built() and hvd_tf.mpi_built()):
        sys.exit("horovod.tensorflow lacks Gloo and/or MPI support")
    import horovod.tensorflow.keras  # noqa: F401  (needs TF_USE_LEGACY_KERAS=1 + the patch)
    print("[install]   horovod.tensorflow.keras imports (TF_USE_LEGACY_KERAS=1)")
EOF
}

step 4 "horovod $HVD_VERSION (PyTorch + TensorFlow, Gloo + MPI)"
BUILT_NOW=0
if [ "$SKIP_HVD" = 1 ]; then
    log "  BLINK_SKIP_HOROVOD=1: skipping the horovod build"
elif stamp_is "$HVD_STAMP" "$HVD_HASH" && horovod_files_ok >/dev/null 2>&1; then
    log "  horovod $HVD_VERSION already built with this patch, skipping the build"
else
    rm -f "$STAMP" "$HVD_STAMP"
    log "  building horovod (takes ~4-8 min on 2 cores) ..."
    # scripts/build_horovod.sh: download/unpack/patch, compile into .venv, verify; its log lines
    # continue these. CPU: no GPU operations (GPU hints in the environment are dropped).
    if [ "$GPU" = 1 ]; then HVD_GPU="${BLINK_HOROVOD_GPU:-nccl}"; else HVD_GPU=none; fi
    PY="$PY" BLINK_HOROVOD_GPU="$HVD_GPU" BLINK_HOROVOD_TF=1 BLINK_HOROVOD_MPI=1 \
        BLINK_BUILD_JOBS="$JOBS" BLINK_BUILD_DIR="$BUILD" BLINK_SITE_TARGET="" \
        BLINK_LOG_TAG=install BLINK_LOG_INDENT="  " BLINK_LOG_SECONDS="$((SECONDS - T0))" \
        bash "$ROOT/scripts/build_horovod.sh" \
        || die "horovod build failed (messages above; log: $BUILD/horovod-build.log)"
    BUILT_NOW=1
fi

# ---------------------------------------------------------------------------
step 5 "verify the horovod build"
if [ "$SKIP_HVD" = 1 ]; then
    log "  BLINK_SKIP_HOROVOD=1: not verifying horovod"
else
    if [ "$BUILT_NOW" = 1 ] || [ "$FAST" = 0 ]; then mode=full; else mode=quick; fi
    verify_horovod "$mode" || die "horovod verification FAILED (see message above; rebuild with BLINK_FORCE=1)"
    echo "$HVD_HASH" >"$HVD_STAMP"
    log "  horovod OK"
fi

# ---------------------------------------------------------------------------
step 6 "pip install -e . (blink_horovod)"
# setup.py/pyproject.toml, plus any .pth hook it copies into site-packages (a copy, so
# a changed hook needs a re-install even in editable mode).
dev_inputs=()
for f in "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT"/ops/*.pth; do [ -f "$f" ] && dev_inputs+=("$f"); done
DEV_HASH="$(sha "${dev_inputs[@]}")"
if stamp_is "$DEV_STAMP" "$DEV_HASH" \
   && "$PY" -c 'import importlib.metadata as m; m.version("blink_horovod")' >/dev/null 2>&1; then
    log "  already installed in editable mode, skipping"
else
    # --no-build-isolation: use the venv's pinned setuptools (PEP 660 editable).
    "$PY" -m pip install --quiet --no-build-isolation --use-pep517 -e "$ROOT" \
        || die "pip install -e . failed"
    echo "$DEV_HASH" >"$DEV_STAMP"
    log "  installed"
fi
"$PY" -c 'import blink_horovod, os; print("[install]   blink_horovod ->", os.path.dirname(blink_horovod.__file__))' \
    || die "blink_horovod does not import from .venv"
# The C twins of hot loops (simulator event loop, CPU streaming copies), built ahead so the first job
# does not compile them in every rank; without a compiler both fall back to Python/numpy.
"$PY" -m blink_horovod.cbuild 2>&1 | sed 's/^/[install]   /' || true

if [ "$SKIP_HVD" = 1 ]; then hv=skipped; else hv=built; fi
# Keep a "built" stamp when a skip-run follows a full install (horovod is still there).
if [ "$hv" = skipped ] && stamp_is "$STAMP" "$SITE_HASH horovod=built"; then hv=built; fi
echo "$SITE_HASH horovod=$hv" >"$STAMP"
log "install complete (horovod: $hv) in $((SECONDS - T0)) s; activate with: source .venv/bin/activate"
