#!/usr/bin/env bash
# count-fruits (count-lines): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ -f count.txt ] && [ ! -L count.txt ] && [ "$(head -c 4096 count.txt 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = '5' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
