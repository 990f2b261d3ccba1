#!/usr/bin/env bash
# create-todo (create-file): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ -f todo.txt ] && [ ! -L todo.txt ] && [ "$(head -c 4096 todo.txt 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = 'water the plants' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
