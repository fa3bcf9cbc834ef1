#!/bin/sh
# A stand-in for vllm / sglang / atom in the launcher tests: records the command line (one
# argument per line), the environment and its pid in $STANDIN_DIR, then becomes the mock engine
# with the same arguments (exec keeps the pid the launcher started and signals).
printf '%s\n' "$@" > "$STANDIN_DIR/argv"
env > "$STANDIN_DIR/env"
echo $$ > "$STANDIN_DIR/pid"
exec "$INFERA_BIN" mock-engine "$@"
