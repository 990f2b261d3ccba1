#!/usr/bin/env bash
# create-poem (create-file): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ -f poem.txt ] && [ ! -L poem.txt ] && [ "$(head -c 4096 poem.txt 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = 'roses are red' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
