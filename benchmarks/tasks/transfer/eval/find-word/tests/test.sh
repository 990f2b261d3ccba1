#!/usr/bin/env bash
# find-word (find-file-by-content): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ -f answer.txt ] && [ ! -L answer.txt ] && [ "$(printf %s "$(head -c 4096 answer.txt 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" | tr 'A-Z' 'a-z' | sed 's/[.]$//')" = 'b.txt' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
