#!/usr/bin/env bash
# Fill .carry/ with what an offline GPU machine lacks to build Horovod 0.28.1 there with
# scripts/build_horovod.sh (BLINK_CARRY=.carry):
#
#   horovod-0.28.1.tar.gz                     the sdist (sha256 checked)
#   cffi-*-cp312-*manylinux*x86_64.whl         Horovod's setup asks for cffi before it builds
#   pycparser-*.whl                            cffi's one dependency
#   mock-*.whl                                 what Horovod's test/utils/common.py imports (its test suite)
#
# Run it on a machine that reaches PyPI; copy .carry/ along with the repository.
# Idempotent: files already present are kept. Prints the sizes at the end.
#
# Environment:
#   PY=path               interpreter whose pip downloads (default .venv/bin/python, else python3)
#   BLINK_CARRY=dir       target folder (default .carry at the repository root)
#   CARRY_PYTHON=3.12     Python version of the GPU machine (wheels are cp<version without dot>)
#   CARRY_CFFI=2.1.1      cffi version
#   CARRY_PYCPARSER=3.12  pycparser version
#   CARRY_MOCK=5.2.0      mock version
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
fi

HVD_VERSION=0.28.1
HVD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
CARRY="${BLINK_CARRY:-$ROOT/.carry}"
PYV="${CARRY_PYTHON:-3.12}"
CFFI="${CARRY_CFFI:-2.1.1}"
PYCPARSER="${CARRY_PYCPARSER:-3.12}"
MOCK="${CARRY_MOCK:-5.2.0}"
if [ -z "${PY:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi

log() { printf '[gpu_carry] %s\n' "$*"; }
die() { printf '[gpu_carry] ERROR: %s\n' "$*" >&2; exit 1; }

"$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip (set PY=...)"
mkdir -p "$CARRY"
PIP_QUIET=(--quiet --progress-bar off --disable-pip-version-check)
# (the grep drops pip's notes about file:// extra indexes that do not exist on this machine)
quiet_pip() { "$PY" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file://.*' is ignored" || true; }; }

# --- the sdist --------------------------------------------------------------------------
SDIST="$CARRY/horovod-$HVD_VERSION.tar.gz"
if [ -f "$SDIST" ] && [ "$(sha256sum "$SDIST" | awk '{print $1}')" = "$HVD_SDIST_SHA256" ]; then
    log "horovod-$HVD_VERSION.tar.gz present"
else
    rm -f "$SDIST"
    if [ -f "$ROOT/.build/sdist/horovod-$HVD_VERSION.tar.gz" ]; then
        log "horovod-$HVD_VERSION.tar.gz: copying the one scripts/install.sh downloaded"
        cp "$ROOT/.build/sdist/horovod-$HVD_VERSION.tar.gz" "$SDIST"
    else
        log "horovod-$HVD_VERSION.tar.gz: downloading"
        # --no-build-isolation: pip reads the sdist's metadata with this interpreter's
        # setuptools instead of fetching its own; an interpreter without the wheel package
        # cannot (no bdist_wheel), so then pip's own isolated build reads it.
        quiet_pip download "${PIP_QUIET[@]}" --no-deps --no-binary :all: --no-build-isolation \
            -d "$CARRY" "horovod==$HVD_VERSION" >/dev/null \
        || quiet_pip download "${PIP_QUIET[@]}" --no-deps --no-binary :all: \
            -d "$CARRY" "horovod==$HVD_VERSION"
    fi
    [ -f "$SDIST" ] || die "no $SDIST after the download"
    got="$(sha256sum "$SDIST" | awk '{print $1}')"
    [ "$got" = "$HVD_SDIST_SHA256" ] || { rm -f "$SDIST"; die "horovod sdist sha256 $got, expected $HVD_SDIST_SHA256"; }
fi

# --- wheels for the GPU machine's interpreter (cp${PYV/./}, manylinux x86_64) -----------
have_wheel() { compgen -G "$CARRY/$1-$2-*.whl" >/dev/null; }
for spec in "cffi==$CFFI" "pycparser==$PYCPARSER" "mock==$MOCK"; do
    name="${spec%%==*}" ver="${spec#*==}"
    if have_wheel "$name" "$ver"; then
        log "$name $ver wheel present"
        continue
    fi
    log "$name $ver: downloading the cp${PYV/./} manylinux x86_64 wheel"
    quiet_pip download "${PIP_QUIET[@]}" --no-deps --only-binary=:all: \
        --python-version "$PYV" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$CARRY" "$spec"
    have_wheel "$name" "$ver" || die "pip download $spec gave no wheel in $CARRY"
done

log "contents of ${CARRY#"$ROOT"/}:"
( cd "$CARRY" && ls -1 ) | while read -r f; do
    printf '[gpu_carry]   %8s  %s\n' "$(du -h "$CARRY/$f" | awk '{print $1}')" "$f"
done
log "total $(du -sh "$CARRY" | awk '{print $1}')"
