#!/usr/bin/env bash
# Build Horovod 0.28.1 from its sdist with patches/horovod-0.28.1.patch into one Python
# interpreter, then verify the build. scripts/install.sh (make install) and docker/Dockerfile
# build through this script; on an offline GPU machine run it directly with BLINK_CARRY.
#
#   bash scripts/build_horovod.sh [--prepare-only | --dry-run | --help]
#
#   --prepare-only   unpack the sdist and apply the patch, do not compile
#   --dry-run        detect everything and print the build environment, touch nothing
#
# Frameworks: PyTorch always (it must be importable), TensorFlow when importable; Gloo
# always, MPI when mpicxx is found. The verification fails loudly: horovod.torch built
# (metadata.json lists pytorch, hvd.init exists), Gloo (and MPI when asked for) built,
# nccl_built() in nccl mode, cuda_built() in cuda mode.
#
# Environment:
#   PY=python3              interpreter to build for (its torch, its site-packages)
#   BLINK_HOROVOD_GPU=auto  auto: nccl when torch is a CUDA build and nvcc / CUDA_HOME is found,
#                                 else none
#                           none: no GPU operations (CPU build; a CUDA torch with nvcc present
#                                 still gets Horovod's CUDA code, as stock Horovod does)
#                           cuda: HOROVOD_GPU=CUDA, no GPU operations: CUDA tensors are staged
#                                 through host memory (several ranks may share one GPU)
#                           nccl: HOROVOD_GPU_OPERATIONS=NCCL (one rank per GPU: NCCL refuses
#                                 two ranks on one device)
#   BLINK_BUILD_JOBS=N      parallel compile jobs (default: all cores)
#   BLINK_CARRY=dir         offline: a folder with horovod-0.28.1.tar.gz and wheels (made by
#                           scripts/gpu_carry.sh); wheels not yet installed are installed with
#                           pip --no-index, and nothing is fetched from the network
#   BLINK_BUILD_DIR=dir     work folder (default .build at the repository root); the build log
#                           is <dir>/horovod-build.log
#   BLINK_SITE_TARGET=dir   install with pip --target dir instead of into PY's site-packages
#                           (use it with PYTHONPATH=dir)
#   BLINK_HOROVOD_TF=auto   auto | 1 (require TensorFlow) | 0 (build without it)
#   BLINK_HOROVOD_MPI=auto  auto | 1 (require MPI) | 0 (build without it)
#   Respected when set: HOROVOD_NCCL_HOME, HOROVOD_BUILD_CUDA_CC_LIST, HOROVOD_CMAKE,
#   CMAKE_POLICY_VERSION_MINIMUM, CXXFLAGS, LDFLAGS.
#
# GPU builds also get: CMAKE_POLICY_VERSION_MINIMUM=3.5 under cmake 4 (the bundled Gloo asks
# for an older cmake), CXXFLAGS with the standard headers newer g++ no longer pulls in,
# HOROVOD_BUILD_CUDA_CC_LIST from the GPUs present (else from torch's and nvcc's lists), and
# for NCCL from the nvidia-nccl wheel: a home folder of links, HOROVOD_NCCL_LINK=SHARED and
# an rpath to the wheel's lib folder.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

HVD_VERSION=0.28.1
HVD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
PATCH="$ROOT/patches/horovod-$HVD_VERSION.patch"

ACTION=build
case "${1:-}" in
    "") ;;
    --prepare-only) ACTION=prepare ;;
    --dry-run) ACTION=dry ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) printf 'build_horovod: unknown argument %s (try --help)\n' "$1" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { printf 'build_horovod: one argument at most (try --help)\n' >&2; exit 2; }

# Log lines: scripts/install.sh sets BLINK_LOG_TAG/BLINK_LOG_INDENT/BLINK_LOG_SECONDS so that
# these lines continue its own.
TAG="${BLINK_LOG_TAG:-build_horovod}"
IND="${BLINK_LOG_INDENT:-}"
SECONDS="${BLINK_LOG_SECONDS:-0}"
log()  { printf '[%s %4ds] %s%s\n' "$TAG" "$SECONDS" "$IND" "$*"; }
die()  { printf '\n[%s] ERROR: %s\n[%s] horovod build FAILED after %ds\n' "$TAG" "$*" "$TAG" "$SECONDS" >&2; exit 1; }
trap 'rc=$?; printf "\n[%s] ERROR: command failed (exit %s) at %s:%s: %s\n" "$TAG" "$rc" "${BASH_SOURCE[0]}" "$LINENO" "$BASH_COMMAND" >&2' ERR

PY="${PY:-python3}"
MODE="${BLINK_HOROVOD_GPU:-auto}"
JOBS="${BLINK_BUILD_JOBS:-$(nproc 2>/dev/null || echo 4)}"
CARRY="${BLINK_CARRY:-}"
BUILD="${BLINK_BUILD_DIR:-$ROOT/.build}"
TARGET="${BLINK_SITE_TARGET:-}"
WANT_TF="${BLINK_HOROVOD_TF:-auto}"
WANT_MPI="${BLINK_HOROVOD_MPI:-auto}"

case "$MODE" in auto|none|cuda|nccl) ;; *) die "BLINK_HOROVOD_GPU=$MODE: use auto, none, cuda or nccl" ;; esac
case "$WANT_TF" in auto|0|1) ;; *) die "BLINK_HOROVOD_TF=$WANT_TF: use auto, 0 or 1" ;; esac
case "$WANT_MPI" in auto|0|1) ;; *) die "BLINK_HOROVOD_MPI=$WANT_MPI: use auto, 0 or 1" ;; esac
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || die "BLINK_BUILD_JOBS=$JOBS is not a positive number"
[ -f "$PATCH" ] || die "missing $PATCH"

abspath() { mkdir -p "$1" && (cd "$1" && pwd); }

PY_BIN="$(command -v "$PY" 2>/dev/null)" || die "PY=$PY: no such interpreter"
# absolute, but not through symlinks (a venv's python is one)
PY_BIN="$(cd "$(dirname "$PY_BIN")" && pwd)/$(basename "$PY_BIN")"
"$PY_BIN" -c 'import sys' 2>/dev/null || die "PY=$PY does not run"
"$PY_BIN" -m pip --version >/dev/null 2>&1 || die "$PY_BIN has no pip"
if [ "$ACTION" != dry ]; then BUILD="$(abspath "$BUILD")"; fi
if [ -n "$TARGET" ]; then
    TARGET="$(abspath "$TARGET")"
    export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
fi
log "interpreter $PY_BIN ($("$PY_BIN" -V 2>&1))${TARGET:+, installing into $TARGET}"

# The sdist (carried, cached in the build folder, or downloaded), unpacked and patched in $SRC
SRC="$BUILD/horovod-$HVD_VERSION"
sha_ok() { [ "$(sha256sum "$1" | awk '{print $1}')" = "$HVD_SDIST_SHA256" ]; }
prepare_source() {
    if [ -n "$CARRY" ]; then
        SDIST="$CARRY/horovod-$HVD_VERSION.tar.gz"
    else
        SDIST="$BUILD/sdist/horovod-$HVD_VERSION.tar.gz"
        if [ ! -f "$SDIST" ]; then
            log "downloading the horovod==$HVD_VERSION sdist"
            mkdir -p "$BUILD/sdist"
            # --no-build-isolation: pip prepares the sdist's metadata with this interpreter's
            # setuptools instead of fetching (and, with --no-binary, compiling) its own.
            "${PIP[@]}" download --quiet --progress-bar off --no-deps --no-binary :all: \
                --no-build-isolation -d "$BUILD/sdist" "horovod==$HVD_VERSION" \
                || die "pip download horovod==$HVD_VERSION failed"
            [ -f "$SDIST" ] || die "pip download did not produce $SDIST"
        fi
    fi
    sha_ok "$SDIST" || die "$SDIST: sha256 is not that of horovod $HVD_VERSION ($HVD_SDIST_SHA256)"

    rm -rf "$SRC"
    tar -xzf "$SDIST" -C "$BUILD"
    [ -d "$SRC" ] || die "unpacking $SDIST did not give $SRC"
    log "applying $(basename "$PATCH")"
    patch -d "$SRC" -p1 --forward --batch <"$PATCH" >"$BUILD/patch.log" 2>&1 \
        || { cat "$BUILD/patch.log" >&2; die "patch $PATCH does not apply to horovod $HVD_VERSION"; }
}

PIP=("$PY_BIN" -m pip)
PIP_TARGET=()
[ -z "$TARGET" ] || PIP_TARGET=(--target "$TARGET" --upgrade)

# ---------------------------------------------------------------------------------------
# Offline: the carried folder
if [ -n "$CARRY" ]; then
    [ -d "$CARRY" ] || die "BLINK_CARRY=$CARRY is not a folder"
    CARRY="$(cd "$CARRY" && pwd)"
    # Anything below (setuptools fetching setup_requires, pip) stays off the network.
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$CARRY" PIP_DISABLE_PIP_VERSION_CHECK=1
    [ -f "$CARRY/horovod-$HVD_VERSION.tar.gz" ] || die "$CARRY has no horovod-$HVD_VERSION.tar.gz (scripts/gpu_carry.sh makes it)"
    to_install=()
    for whl in "$CARRY"/*.whl; do
        [ -e "$whl" ] || continue
        dist="$(basename "$whl")"; dist="${dist%%-*}"
        if "$PY_BIN" -c 'import sys, importlib.metadata as m; m.version(sys.argv[1])' "$dist" >/dev/null 2>&1; then
            log "carried $(basename "$whl"): $dist already installed"
        else
            to_install+=("$whl")
        fi
    done
    if [ ${#to_install[@]} -gt 0 ]; then
        if [ "$ACTION" != build ]; then
            log "would install from $CARRY: ${to_install[*]##*/}"
        else
            log "installing from $CARRY (no index): ${to_install[*]##*/}"
            "${PIP[@]}" install --quiet --no-index --no-deps --find-links "$CARRY" "${PIP_TARGET[@]}" "${to_install[@]}" \
                || die "pip install of the carried wheels failed"
        fi
    fi
fi

if [ "$ACTION" = prepare ]; then
    prepare_source
    log "prepared $SRC (--prepare-only: not compiling)"
    exit 0
fi

# Horovod's setup.py asks for these before building (setup_requires); missing ones would be
# fetched from the network.
missing="$("$PY_BIN" - <<'EOF'
import importlib.util
need = {"setuptools": "setuptools", "cffi": "cffi", "cloudpickle": "cloudpickle", "psutil": "psutil",
        "yaml": "pyyaml", "packaging": "packaging"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
EOF
)"
if [ -n "$missing" ]; then
    if [ -n "$CARRY" ] && [ "$ACTION" = build ]; then
        die "not importable: $missing; put their wheels in $CARRY (scripts/gpu_carry.sh)"
    fi
    if [ -n "$CARRY" ]; then
        log "note: not importable yet: $missing (a build installs the carried wheels first, then needs them)"
    else
        log "note: not importable yet: $missing (setuptools will try to fetch them)"
    fi
fi

# ---------------------------------------------------------------------------------------
# What is there: torch (required), CUDA, TensorFlow, MPI, cmake, compiler
probe="$("$PY_BIN" - <<'EOF' 2>/dev/null
import torch
from torch.utils.cpp_extension import CUDA_HOME
try:  # the targets torch was compiled for; needs no GPU (torch.cuda.get_arch_list() does)
    archs = torch._C._cuda_getArchFlags().split() if torch.version.cuda else []
except Exception:
    archs = []
print(torch.__version__, torch.version.cuda or "none", CUDA_HOME or "none", ",".join(archs) or "none")
EOF
)" || die "torch does not import in $PY_BIN: install torch first (horovod's setup compiles against it)"
read -r TORCH_VER TORCH_CUDA CUDA_HOME_T TORCH_ARCHS <<<"$probe"
log "torch $TORCH_VER (CUDA: $TORCH_CUDA, CUDA_HOME: $CUDA_HOME_T)"

GPU_OK=0
[ "$TORCH_CUDA" != none ] && [ "$CUDA_HOME_T" != none ] && [ -x "$CUDA_HOME_T/bin/nvcc" ] && GPU_OK=1
if [ "$MODE" = auto ]; then
    if [ "$GPU_OK" = 1 ]; then MODE=nccl; else MODE=none; fi
    log "BLINK_HOROVOD_GPU=auto -> $MODE"
fi
if [ "$MODE" != none ] && [ "$GPU_OK" != 1 ]; then
    [ "$TORCH_CUDA" != none ] || die "BLINK_HOROVOD_GPU=$MODE needs a CUDA build of torch; torch $TORCH_VER is not"
    die "BLINK_HOROVOD_GPU=$MODE needs nvcc: none at CUDA_HOME=$CUDA_HOME_T (set CUDA_HOME or put nvcc on PATH)"
fi

if [ "$WANT_TF" = auto ]; then
    if TF_CPP_MIN_LOG_LEVEL=3 "$PY_BIN" -c 'import tensorflow' >/dev/null 2>&1; then WANT_TF=1; else WANT_TF=0; fi
fi
if [ "$WANT_MPI" = auto ]; then
    if command -v mpicxx >/dev/null 2>&1 || command -v mpicc >/dev/null 2>&1; then WANT_MPI=1; else WANT_MPI=0; fi
fi

# env for the build: UNSET (names) go first as `env -u NAME`, then BENV (NAME=VALUE)
UNSET=()
BENV=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$JOBS")
if [ "$WANT_TF" = 1 ]; then BENV+=(HOROVOD_WITH_TENSORFLOW=1); else BENV+=(HOROVOD_WITHOUT_TENSORFLOW=1); fi
if [ "$WANT_MPI" = 1 ]; then BENV+=(HOROVOD_WITH_MPI=1); else BENV+=(HOROVOD_WITHOUT_MPI=1); fi

# cmake: the one horovod's setup.py will run
CMAKE_BIN="${HOROVOD_CMAKE:-}"
if [ -z "$CMAKE_BIN" ]; then
    if command -v cmake >/dev/null 2>&1; then CMAKE_BIN=cmake
    elif [ -x "$(dirname "$PY_BIN")/cmake" ]; then CMAKE_BIN="$(dirname "$PY_BIN")/cmake"; BENV+=(HOROVOD_CMAKE="$CMAKE_BIN")
    else die "no cmake on PATH (nor beside $PY_BIN); install cmake >= 3.13"; fi
fi
CMAKE_VER="$("$CMAKE_BIN" --version 2>/dev/null | grep -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' | head -n 1)" \
    || die "$CMAKE_BIN --version failed"
CMAKE_MAJOR="${CMAKE_VER%%.*}" CMAKE_MINOR="${CMAKE_VER#*.}"; CMAKE_MINOR="${CMAKE_MINOR%%.*}"
if [ "$CMAKE_MAJOR" -lt 3 ] || { [ "$CMAKE_MAJOR" -eq 3 ] && [ "$CMAKE_MINOR" -lt 13 ]; }; then
    die "cmake $CMAKE_VER is older than 3.13 (horovod's setup would pip-install one)"
fi
if [ "$CMAKE_MAJOR" -ge 4 ] && [ -z "${CMAKE_POLICY_VERSION_MINIMUM:-}" ]; then
    BENV+=(CMAKE_POLICY_VERSION_MINIMUM=3.5)   # the bundled Gloo's cmake_minimum_required
fi
CXX_BIN="${CXX:-g++}"
command -v "$CXX_BIN" >/dev/null 2>&1 || die "no C++ compiler ($CXX_BIN) on PATH (set CXX)"
log "cmake $CMAKE_VER, $("$CXX_BIN" --version 2>/dev/null | head -n 1), MPI: $([ "$WANT_MPI" = 1 ] && echo yes || echo no)"

NCCL_LIB=""
if [ "$MODE" = none ]; then
    # no GPU operations: drop any GPU hints from the caller's environment
    UNSET+=(HOROVOD_GPU HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST
            HOROVOD_GPU_ALLGATHER HOROVOD_GPU_ALLTOALL HOROVOD_GPU_REDUCESCATTER)
else
    BENV+=(HOROVOD_GPU=CUDA HOROVOD_CUDA_HOME="$CUDA_HOME_T")
    # g++ >= 13 no longer includes these transitively; Horovod's CUDA paths rely on it.
    GPU_CXXFLAGS="-include stdexcept -include string -include unordered_map -include vector -include algorithm -include cstdint -include memory"
    BENV+=(CXXFLAGS="${CXXFLAGS:+$CXXFLAGS }$GPU_CXXFLAGS")
    # compute capabilities: given, else the GPUs present, else torch's targets that nvcc knows
    CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-}"
    CC_FROM="HOROVOD_BUILD_CUDA_CC_LIST"
    if [ -z "$CC_LIST" ] && command -v nvidia-smi >/dev/null 2>&1; then
        CC_LIST="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
            | tr -d ' .' | grep -E '^[0-9]+$' | sort -n -u | paste -sd, - || true)"
        CC_FROM="the GPUs present"
    fi
    if [ -z "$CC_LIST" ] && [ "$TORCH_ARCHS" != none ]; then
        nvcc_archs="$("$CUDA_HOME_T/bin/nvcc" --list-gpu-arch 2>/dev/null | grep -oE '[0-9]+' | sort -n -u || true)"
        CC_LIST="$(tr ',' '\n' <<<"$TORCH_ARCHS" | grep -oE '^sm_[0-9]+$' | sed 's/^sm_//' | sort -n -u \
            | { if [ -n "$nvcc_archs" ]; then grep -xF -f <(printf '%s\n' "$nvcc_archs"); else cat; fi; } \
            | paste -sd, - || true)"
        CC_FROM="torch's arch list and nvcc"
    fi
    if [ -n "$CC_LIST" ]; then
        BENV+=(HOROVOD_BUILD_CUDA_CC_LIST="$CC_LIST")
        log "CUDA compute capabilities $CC_LIST (from $CC_FROM)"
    else
        log "CUDA compute capabilities: all nvcc supports (no GPU seen; set HOROVOD_BUILD_CUDA_CC_LIST to narrow)"
    fi
    if [ "$MODE" = cuda ]; then
        UNSET+=(HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST
                HOROVOD_GPU_ALLGATHER HOROVOD_GPU_ALLTOALL HOROVOD_GPU_REDUCESCATTER)
    else
        BENV+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED)
        if [ -n "${HOROVOD_NCCL_HOME:-}" ]; then
            log "NCCL from HOROVOD_NCCL_HOME=$HOROVOD_NCCL_HOME"
        else
            # the nvidia-nccl wheel next to torch (the NCCL torch itself loads)
            nccl_pkg="$("$PY_BIN" -c 'import importlib.util as u; s = u.find_spec("nvidia.nccl"); print(s.submodule_search_locations[0] if s else "")' 2>/dev/null || true)"
            if [ -n "$nccl_pkg" ] && [ -f "$nccl_pkg/include/nccl.h" ] && [ -e "$nccl_pkg/lib/libnccl.so.2" ]; then
                NCCL_LIB="$(cd "$nccl_pkg/lib" && pwd -P)"
                NCCL_HOME="$BUILD/nccl-home"
                if [ "$ACTION" != dry ]; then
                    rm -rf "$NCCL_HOME"
                    mkdir -p "$NCCL_HOME/lib"
                    ln -s "$(cd "$nccl_pkg/include" && pwd -P)" "$NCCL_HOME/include"
                    ln -s "$NCCL_LIB/libnccl.so.2" "$NCCL_HOME/lib/libnccl.so"
                fi
                BENV+=(HOROVOD_NCCL_HOME="$NCCL_HOME" LDFLAGS="${LDFLAGS:+$LDFLAGS }-Wl,-rpath,$NCCL_LIB")
                log "NCCL from the nvidia-nccl wheel ($NCCL_LIB), linked through $NCCL_HOME"
            else
                log "NCCL: no nvidia-nccl wheel; cmake searches the CUDA toolkit and system folders"
            fi
        fi
    fi
fi

BUILD_LOG="$BUILD/horovod-build.log"
PIP_BUILD=(install --no-build-isolation --no-deps --no-cache-dir --progress-bar off -v "${PIP_TARGET[@]}")
[ -z "$CARRY" ] || PIP_BUILD+=(--no-index)
ENV_ARGS=()
for v in "${UNSET[@]}"; do ENV_ARGS+=(-u "$v"); done
ENV_ARGS+=("${BENV[@]}")
log "mode $MODE: TensorFlow $([ "$WANT_TF" = 1 ] && echo yes || echo no), Gloo yes, MPI $([ "$WANT_MPI" = 1 ] && echo yes || echo no), -j$JOBS"

if [ "$ACTION" = dry ]; then
    log "dry run: would unpack into $SRC, apply $(basename "$PATCH") and run"
    printf '  env'; printf ' %q' "${ENV_ARGS[@]}"; printf ' \\\n    %q -m pip' "$PY_BIN"; printf ' %q' "${PIP_BUILD[@]}" "$SRC"; printf '\n'
    exit 0
fi

# ---------------------------------------------------------------------------------------
prepare_source
log "compiling (log: ${BUILD_LOG#"$ROOT"/}, MAKEFLAGS=-j$JOBS)"
env "${ENV_ARGS[@]}" "$PY_BIN" -m pip "${PIP_BUILD[@]}" "$SRC" >"$BUILD_LOG" 2>&1 &
pid=$!
t_build=$SECONDS
rc=0
while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    if [ $(( (SECONDS - t_build) % 30 )) -lt 5 ] && kill -0 "$pid" 2>/dev/null; then
        pct="$(grep -aoE '\[ *[0-9]+%\]' "$BUILD_LOG" 2>/dev/null | tail -n 1 | tr -d '[] ' || true)"
        log "... still compiling ($((SECONDS - t_build)) s${pct:+, cmake at $pct})"
    fi
done
wait "$pid" || rc=$?
if [ "$rc" -ne 0 ]; then
    echo "------ last 60 lines of $BUILD_LOG ------" >&2
    tail -n 60 "$BUILD_LOG" >&2
    die "horovod build failed (exit $rc); full log: $BUILD_LOG"
fi
log "horovod compiled and installed in $((SECONDS - t_build)) s"

# ---------------------------------------------------------------------------------------
verify() {
    TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}" \
    "$PY_BIN" - "$HVD_VERSION" "$MODE" "$WANT_TF" "$WANT_MPI" "$TAG" "$IND" <<'EOF'
import importlib.util, json, os, sys
want_version, mode, want_tf, want_mpi, tag, ind = sys.argv[1:7]
say = lambda msg: print(f"[{tag}]      {ind}{msg}", flush=True)
spec = importlib.util.find_spec("horovod")
if spec is None or not spec.submodule_search_locations:
    sys.exit("horovod is not importable after the build")
d = spec.submodule_search_locations[0]
from importlib.metadata import version
if version("horovod") != want_version:
    sys.exit(f"horovod {version('horovod')} installed, want {want_version}")
meta = json.load(open(os.path.join(d, "metadata.json")))
say(f"{d}: metadata.json {json.dumps(meta)}")
need = ["pytorch"] + (["tensorflow"] if want_tf == "1" else [])
missing = [k for k in need if meta.get(k) in (None, "", "none")]
if missing:
    sys.exit(f"metadata.json does not list {missing}: horovod was built WITHOUT them")
import horovod.torch as hvd
if not callable(getattr(hvd, "init", None)):
    sys.exit("horovod.torch has no init(): the extension was not built")
built = dict(gloo=hvd.gloo_built(), mpi=hvd.mpi_built(), nccl=hvd.nccl_built(), cuda=hvd.cuda_built())
say("horovod.torch: " + " ".join(f"{k}_built()={v}" for k, v in built.items()))
fails = []
if not built["gloo"]:
    fails.append("Gloo")
if want_mpi == "1" and not built["mpi"]:
    fails.append("MPI")
if mode == "nccl" and not built["nccl"]:
    fails.append("NCCL")
if mode in ("cuda", "nccl") and not built["cuda"]:
    fails.append("CUDA")
if fails:
    sys.exit(f"horovod.torch was built without {', '.join(fails)}")
if want_tf == "1":
    import horovod.tensorflow as hvd_tf
    if not hvd_tf.gloo_built():
        sys.exit("horovod.tensorflow lacks Gloo")
    say("horovod.tensorflow imports")
EOF
}
log "verifying"
if verify; then
    :
elif [ -n "$NCCL_LIB" ] && LD_LIBRARY_PATH="$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" verify; then
    log "WARNING: horovod needs the NCCL lib folder at run time: export LD_LIBRARY_PATH=$NCCL_LIB:\$LD_LIBRARY_PATH"
else
    die "horovod verification FAILED (message above); build log: $BUILD_LOG"
fi
log "horovod $HVD_VERSION OK (mode $MODE)${TARGET:+; use it with PYTHONPATH=$TARGET}"
