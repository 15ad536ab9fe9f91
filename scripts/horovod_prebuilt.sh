#!/usr/bin/env bash
# A Horovod build for CUDA tensors, packed once and reused: the GPU machine starts bare every time,
# and building Horovod there costs about 100 s of each acceptance call.
#
#   bash scripts/horovod_prebuilt.sh key              what a pack is valid for (printed)
#   bash scripts/horovod_prebuilt.sh pack FILE.tgz    the installed Horovod (package, metadata,
#                                                     horovodrun), shared objects stripped, and its key
#   bash scripts/horovod_prebuilt.sh unpack FILE.tgz  install it, if its key is this machine's
#                                                     (exit 3 when it is not: build instead)
#
# The key names what the build depends on: the interpreter, torch's version, Horovod's sdist and the
# GPU mode (BLINK_HOROVOD_GPU, default cuda).  PY=python3 by default.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=${PY:-python3}
log() { printf '[horovod_prebuilt] %s\n' "$*"; }
die() { printf '[horovod_prebuilt] ERROR: %s\n' "$*" >&2; exit 1; }

key() {
    local sdist="$ROOT/.carry/horovod-0.28.1.tar.gz" sum="no-sdist"
    [ -f "$sdist" ] && sum=$(sha256sum "$sdist" | cut -c1-16)
    printf '%s torch-%s horovod-sdist-%s gpu-%s\n' \
        "$("$PY" -c 'import sys; print("py%d.%d" % sys.version_info[:2])')" \
        "$("$PY" -c 'import torch; print(torch.__version__)')" "$sum" "${BLINK_HOROVOD_GPU:-cuda}"
}

site() { "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

case "${1:-}" in
key)
    key ;;
pack)
    out=${2:?pack needs the output file}
    pkg=$("$PY" -c 'import horovod, os; print(os.path.dirname(horovod.__file__))') || die "horovod is not installed"
    run=$(command -v horovodrun) || die "horovodrun is not on PATH"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$tmp/site" "$tmp/bin"
    cp -a "$pkg" "$tmp/site/"
    cp -a "$(dirname "$pkg")"/horovod-*.dist-info "$tmp/site/" 2>/dev/null || true
    cp -a "$run" "$tmp/bin/"
    find "$tmp/site" -name '__pycache__' -prune -exec rm -rf {} +
    if command -v strip >/dev/null; then
        find "$tmp/site" -name '*.so' -exec strip --strip-unneeded {} + || true
    fi
    key >"$tmp/KEY"
    tar czf "$out" -C "$tmp" KEY site bin
    log "packed $(du -h "$out" | cut -f1) for $(cat "$tmp/KEY")" ;;
unpack)
    file=${2:?unpack needs the pack}
    [ -f "$file" ] || { log "no $file"; exit 3; }
    want=$(key)
    have=$(tar xzf "$file" -O KEY 2>/dev/null || true)
    if [ "$have" != "$want" ]; then
        log "$file was built for '$have', this machine is '$want': build instead"
        exit 3
    fi
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    tar xzf "$file" -C "$tmp"
    dest=$(site)
    bindir=$(dirname "$(command -v "$PY")")
    rm -rf "$dest/horovod" "$dest"/horovod-*.dist-info
    cp -a "$tmp/site/." "$dest/"
    cp -a "$tmp/bin/." "$bindir/"
    "$PY" -c 'import horovod.torch' || die "the unpacked Horovod does not import"
    log "installed the prebuilt Horovod ($want) into $dest" ;;
*)
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
    [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ] ;;
esac
