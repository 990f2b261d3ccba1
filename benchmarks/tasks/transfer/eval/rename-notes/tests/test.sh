#!/usr/bin/env bash
# rename-notes (rename-file): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ ! -e notes.md ] && [ -f report.md ] && [ ! -L report.md ] && [ "$(head -c 4096 report.md 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = '# notes
all good' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
