#!/usr/bin/env bash
# delete-temp (delete-file): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ ! -e temp.txt ] && [ -f keep.txt ] && [ ! -L keep.txt ] && [ "$(head -c 4096 keep.txt 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = 'keep me' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
