#!/usr/bin/env bash
# append-names (append-line): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ -f names.txt ] && [ ! -L names.txt ] && [ "$(head -c 4096 names.txt 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = 'alice
bob
carol' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
