#!/bin/sh
# An engine that starts and never answers (for the launcher's readiness timeout test).
echo $$ > "$STANDIN_DIR/pid"
exec sleep 600
