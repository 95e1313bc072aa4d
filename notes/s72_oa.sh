#!/bin/bash
# (notes/offset_addresses.patch was removed after this ran; it is in git at 54fb5e1: notes/PATCHES.md)
# session 72: notes/offset_addresses.patch (csrc/experts.cu's k loops on one moving base pointer with 32-bit offsets)
# against main in the reverse order of call 2 (which had main first: 0.2-0.3 us faster at batch <= 16), with the
# expert suite on the patched build; then, with SAN_TOO=1, memcheck and racecheck of experts.cu's configurations
# (WS's kernels are untouched by the patch)
bash notes/compare_variants.sh -s "layerq texp" oa=notes/offset_addresses.patch -s layerq main= | grep -v "^[0-9.]*+"
[ -n "$SAN_TOO" ] || exit 0
git apply notes/offset_addresses.patch || exit 1
SAN=default,T16,T32,W64,W128 bash notes/device_trial.sh mem race | grep -v "^[0-9.]*+"
git apply -R notes/offset_addresses.patch
