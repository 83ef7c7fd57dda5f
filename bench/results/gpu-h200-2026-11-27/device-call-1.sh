#!/usr/bin/env bash
# The first of the three calls of 2026-11-27 on a lent GPU (device tool, .device-pack carried;
# built here and packed with `scripts/device-bundle --swizzle`). Each step under its own limit, so
# that the 15 minutes of device time hold all of them; device-check packs its work folder into
# $OUT/device-check.tar.gz after every step, so a cut still brings back what ran. As run at
# 42b2d7f: the swizzle step (and device-bundle's --swizzle) went after it (README.md).
set -u
t0=$(date +%s)
STEP_TIMEOUT=100 scripts/device-check tests
STEP_TIMEOUT=90 scripts/device-check memcheck
STEP_TIMEOUT=110 scripts/device-check bench
STEP_TIMEOUT=170 scripts/device-check swizzle
STEP_TIMEOUT=100 scripts/device-check sweep
STEP_TIMEOUT=50 scripts/device-check profile
echo "[$(($(date +%s) - t0)) s] all done"
