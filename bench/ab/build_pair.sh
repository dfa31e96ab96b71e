#!/usr/bin/env bash
# Device builds for a patch A/B: the tree as it is -> /tmp/pkg_base, then the tree with PATCH applied -> /tmp/pkg_NAME
# (scripts/device_build.sh; the patch stays applied). Usage: bash bench/ab/build_pair.sh PATCH NAME
set -e
patch_file=$1 name=$2
bash scripts/device_build.sh > /tmp/build_base.log 2>&1 || { tail -30 /tmp/build_base.log; exit 1; }
rm -rf /tmp/pkg_base && cp -r build/device/pkg /tmp/pkg_base
patch -p1 < "$patch_file" > /dev/null
bash scripts/device_build.sh > /tmp/build_$name.log 2>&1 || { tail -30 /tmp/build_$name.log; exit 1; }
rm -rf /tmp/pkg_$name && cp -r build/device/pkg /tmp/pkg_$name
