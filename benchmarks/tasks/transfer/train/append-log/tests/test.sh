#!/usr/bin/env bash
# append-log (append-line): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ -f log.txt ] && [ ! -L log.txt ] && [ "$(head -c 4096 log.txt 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = 'started
running
done' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
