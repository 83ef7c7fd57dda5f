#!/bin/bash
# As sweep.sh, in bf16.
DT=bf16 exec "$(dirname "$0")/sweep.sh"
