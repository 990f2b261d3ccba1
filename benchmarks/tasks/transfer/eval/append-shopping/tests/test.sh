#!/usr/bin/env bash
# append-shopping (append-line): reward 1 when the work dir passes the check below
chmod -R go-rwx /tests
cd /app || exit 2
mkdir -p /logs/verifier
if [ -f shopping.txt ] && [ ! -L shopping.txt ] && [ "$(head -c 4096 shopping.txt 2>/dev/null | tr -d '\r' | sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' | sed '/^$/d')" = 'milk
eggs
rice
bread' ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
