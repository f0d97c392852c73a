#!/usr/bin/env bash
# Compile caches between fresh GPU machines of the same kind and the same staged vLLM:
#
#     bash scripts/gpu/caches.sh save OUTDIR [PART_MIB]   # the caches as OUTDIR/caches.tar.{zst,gz}.NN
#     bash scripts/gpu/caches.sh load DIR                 # unpack DIR/caches.tar.*.NN in place
#
# A fresh machine spends minutes of a first boot compiling: FlashInfer's JIT modules (its attention
# prefill for fp8 KV: minutes each), Triton kernels (the GDN and attention kernels, autotuned),
# torch.compile's graphs and Inductor's kernels. These are keyed by source, shapes and device, so a
# later machine with the same GPU and vLLM reuses them. save packs FlashInfer's JIT cache, Triton's
# cache, vLLM's cache root (torch_compile_cache) and Inductor's folder, in gzip parts of at most
# PART_MIB (default 15; gzip because the GPU machines have no zstd); if they come to more than
# CACHES_MAX_MIB (default 60: what one GPU call brings back in its files, 64 MiB in all; an 82 MiB
# save came back without its last two parts),
# Inductor's folder is left out, then FlashInfer's builds (scripts/gpu/prebuild_flashinfer.py
# rebuilds them in the background, ~170 s), then vLLM's compile cache last (it took a boot from
# 318 s to 103 s). load is a no-op without parts; it also reads zstd parts where zstd is installed.
set -euo pipefail
verb=${1:?usage: caches.sh save OUTDIR [PART_MIB] | load DIR}
dir=${2:?usage: caches.sh save OUTDIR [PART_MIB] | load DIR}
TRITON=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
VLLM_ROOT=${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}
INDUCTOR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}
FLASHINFER=${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer
MAX_MIB=${CACHES_MAX_MIB:-60}
case "$verb" in
  save)
    ext=gz Z=(gzip -6)
    mkdir -p "$dir"
    sets=("$FLASHINFER $TRITON $VLLM_ROOT $INDUCTOR" "$FLASHINFER $TRITON $VLLM_ROOT" "$TRITON $VLLM_ROOT" "$TRITON")
    for set in "${sets[@]}"; do
      # shellcheck disable=SC2086  # a list of folders
      paths=$(for p in $set; do if [ -d "$p" ]; then echo "$p"; fi; done)
      [ -n "$paths" ] || { echo "caches.sh: no cache folder to save" >&2; exit 0; }
      # shellcheck disable=SC2086
      tar cf - $paths 2>/dev/null | "${Z[@]}" > "$dir/caches.tar.$ext"
      mib=$(( $(stat -c %s "$dir/caches.tar.$ext") / 1048576 ))
      [ "$mib" -le "$MAX_MIB" ] && break
      echo "caches.sh: $set came to $mib MiB, trying less" >&2
    done
    rm -f "$dir"/caches.tar.*.[0-9][0-9]
    split -b "${3:-15}M" -d "$dir/caches.tar.$ext" "$dir/caches.tar.$ext."
    rm -f "$dir/caches.tar.$ext"
    echo "caches.sh: saved $(echo $paths) in $(ls "$dir"/caches.tar.$ext.* | wc -l) parts, $mib MiB" ;;
  load)
    if ls "$dir"/caches.tar.zst.[0-9][0-9] >/dev/null 2>&1; then
      command -v zstd >/dev/null || { echo "caches.sh: $dir holds zstd parts and zstd is not installed: install zstd, or save the caches again (saves are gzip now)" >&2; exit 1; }
      ext=zst UNZ=(zstd -q -d)
    elif ls "$dir"/caches.tar.gz.[0-9][0-9] >/dev/null 2>&1; then ext=gz UNZ=(gzip -d)
    else echo "caches.sh: no parts in $dir"; exit 0; fi
    cat "$dir"/caches.tar.$ext.[0-9][0-9] | "${UNZ[@]}" | tar xf - -C /
    echo "caches.sh: loaded $(cat "$dir"/caches.tar.$ext.[0-9][0-9] | "${UNZ[@]}" | tar tf - | wc -l) files" ;;
  *) echo "caches.sh: unknown verb $verb (save, load)" >&2; exit 2 ;;
esac
