#!/usr/bin/env bash
# rename-draft (rename-file): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ ! -e draft.txt ] && [ -f final.txt ] && [ ! -L final.txt ] && [ "$(head -c 4096 final.txt 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = 'my draft' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
