#!/usr/bin/env bash
# create-greeting (create-file): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ -f greeting.txt ] && [ ! -L greeting.txt ] && [ "$(head -c 4096 greeting.txt 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = 'good morning' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
